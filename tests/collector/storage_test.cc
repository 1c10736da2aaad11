// Stored snapshots on disk: retention limits evict the oldest first (with a log line), damaged
// files are reported and skipped at start, and ids are never reused, across restarts and
// evictions alike.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "harness.h"

namespace hdtest {
namespace {

class StorageTest : public ::testing::Test {
 protected:
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
  Collector collector{dir};

  std::string SnapshotFile(uint32_t id) const {
    return collector.storage + "/snapshot-" + std::to_string(id) + ".hdsnap";
  }
  std::set<std::string> Names() {
    std::set<std::string> names;
    for (const Stored &s : List(collector.socket).items) names.insert(s.name);
    return names;
  }
  // Stores a named snapshot from child and returns its id.
  uint32_t Store(Child &child, const std::string &name) {
    EXPECT_EQ(child.Snapshot(name), 0) << name;
    return StoredId(List(collector.socket), name);
  }
  bool Logged(const std::string &what) { return collector.Log().find(what) != std::string::npos; }
  std::string Evicted(uint32_t id) { return "evicted stored snapshot " + std::to_string(id) + " "; }
};

off_t FileSize(const std::string &path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

TEST_F(StorageTest, RetentionByCountEvictsTheOldestFirst) {
  collector.args = {"--max-stored", "2"};
  collector.Start();
  Child child(collector.socket, nullptr);
  uint32_t s1 = Store(child, "s1"), s2 = Store(child, "s2");
  ASSERT_NE(s1, 0u);
  ASSERT_NE(s2, 0u);
  uint32_t s3 = Store(child, "s3");
  EXPECT_EQ(Names(), (std::set<std::string>{"s2", "s3"}));
  uint32_t s4 = Store(child, "s4");
  EXPECT_EQ(Names(), (std::set<std::string>{"s3", "s4"}));
  EXPECT_TRUE(Logged(Evicted(s1)));
  EXPECT_TRUE(Logged(Evicted(s2)));
  EXPECT_FALSE(Logged(Evicted(s3)));
  EXPECT_EQ(FileSize(SnapshotFile(s1)), -1);
  EXPECT_EQ(Download(collector.socket, s1)->error,
            Error(heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND));
  auto kept = Download(collector.socket, s4);
  ASSERT_EQ(kept->status, HD_OK) << kept->ra.error;
  EXPECT_EQ(Blocks(kept->only(), 100, "alpha_leaks").in_function, 10u);

  // A lower limit applies at start.
  collector.Stop();
  collector.args = {"--max-stored", "1"};
  collector.Start();
  EXPECT_EQ(Names(), (std::set<std::string>{"s4"}));
  EXPECT_TRUE(Logged(Evicted(s3)));

  // Ids go on from the highest ever handed out, after evictions, a restart and a kill -9.
  uint32_t s5 = Store(child, "s5");
  EXPECT_GT(s5, s4);
  collector.Stop(SIGKILL);
  collector.Start();
  uint32_t s6 = Store(child, "s6");
  EXPECT_GT(s6, s5);
  EXPECT_EQ(Names(), (std::set<std::string>{"s6"}));
  child.Finish();
}

TEST_F(StorageTest, RetentionByBytesEvictsTheOldestFirst) {
  collector.Start();
  Child child(collector.socket, nullptr);
  uint32_t first = Store(child, "first");
  off_t size = FileSize(SnapshotFile(first));
  ASSERT_GT(size, 0);
  collector.Stop();
  // Room for two snapshots of this program, not three.
  const off_t limit = size * 5 / 2;
  collector.args = {"--max-storage-bytes", std::to_string(limit)};
  collector.Start();
  EXPECT_EQ(Names(), (std::set<std::string>{"first"}));
  Store(child, "second");
  EXPECT_EQ(Names(), (std::set<std::string>{"first", "second"}));
  uint32_t third = Store(child, "third");
  EXPECT_EQ(Names(), (std::set<std::string>{"second", "third"}));
  EXPECT_TRUE(Logged(Evicted(first)));
  Store(child, "fourth");
  EXPECT_EQ(Names(), (std::set<std::string>{"third", "fourth"}));
  off_t total = 0;
  for (const Stored &s : List(collector.socket).items) total += FileSize(SnapshotFile(s.id));
  EXPECT_LE(total, limit);
  EXPECT_GT(FileSize(SnapshotFile(third)), 0);
  child.Finish();
}

void WriteFile(const std::string &path, const std::string &bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

TEST_F(StorageTest, DamagedFilesAreReportedAndSkipped) {
  collector.Start();
  uint32_t good = 0, truncated = 0;
  {
    Child child(collector.socket, "good");
    good = StoredId(List(collector.socket), "good");
    truncated = Store(child, "truncated");
    child.Finish();
  }
  ASSERT_NE(good, 0u);
  ASSERT_NE(truncated, 0u);
  collector.Stop();

  const std::string whole = ReadFile(SnapshotFile(truncated));
  ASSERT_GT(whole.size(), 100u);
  WriteFile(SnapshotFile(truncated), whole.substr(0, whole.size() - 7));  // cut in a record
  std::mt19937 rng(7);
  std::string garbage(5000, '\0');
  for (char &c : garbage) c = static_cast<char>(rng());
  WriteFile(SnapshotFile(900), garbage);
  WriteFile(SnapshotFile(901), "");
  WriteFile(SnapshotFile(902), ReadFile(SnapshotFile(good)));  // another id inside
  WriteFile(SnapshotFile(903), std::string("HDSNAP01\0\0\0\0\xff\xff\xff\xff", 16));
  WriteFile(collector.storage + "/.tmp-77", "an interrupted store");
  WriteFile(collector.storage + "/notes.txt", "not a snapshot");
  WriteFile(collector.storage + "/next-id", "garbage");

  collector.Start();
  auto listing = List(collector.socket);
  ASSERT_EQ(listing.items.size(), 1u);
  EXPECT_EQ(listing.items[0].id, good);
  for (uint32_t id : {truncated, 900u, 901u, 902u, 903u}) {
    EXPECT_TRUE(Logged("skipping damaged stored snapshot " + SnapshotFile(id))) << id;
    EXPECT_EQ(Download(collector.socket, id)->error,
              Error(heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND))
        << id;
  }
  EXPECT_EQ(FileSize(collector.storage + "/.tmp-77"), -1);
  auto kept = Download(collector.socket, good);
  ASSERT_EQ(kept->status, HD_OK) << kept->ra.error;
  EXPECT_EQ(Blocks(kept->only(), 100, "alpha_leaks").in_function, 10u);
  // Even the ids of damaged files stay taken.
  Child child(collector.socket, "new");
  EXPECT_GT(StoredId(List(collector.socket), "new"), 903u);
  EXPECT_EQ(ReadFile(SnapshotFile(900)), garbage);
  child.Finish();
}

}  // namespace
}  // namespace hdtest
