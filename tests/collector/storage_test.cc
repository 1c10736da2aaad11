// Stored snapshots on disk: retention limits evict the oldest first (with a log line), damaged
// files are reported and skipped at start, and ids are never reused, across restarts and
// evictions alike.
#include <fcntl.h>
#include <pb_encode.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "harness.h"
#include "heapdump/heapdump.h"

extern "C" {
#include "heapdump_client.pb.h"
}

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

// Runs the collector in the foreground with `storage` until it exits (it must refuse to start).
ShellOutput StartWithStorage(const std::string &dir, const std::string &storage) {
  return RunShell("exec timeout 20 '" HD_COLLECTOR "' --foreground --socket '" + dir +
                      "/run/c.sock' --storage '" + storage + "'",
                  dir, {"PATH=/usr/bin:/bin"});
}

// Like the socket's, the storage directory must be the collector's own and private: one that
// others may read or write, or a symbolic link, is refused with the reason, and left untouched.
TEST_F(StorageTest, AStorageDirectoryNotPrivatelyOursIsRefused) {
  const std::string open_dir = dir + "/open";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(chmod(open_dir.c_str(), 0755), 0);
  ShellOutput refused = StartWithStorage(dir, open_dir);
  EXPECT_NE(refused.status, 0) << refused.out;
  EXPECT_NE(refused.out.find("storage directory " + open_dir + " must be owned by uid " +
                             std::to_string(geteuid()) + " with mode 0700 (it is uid " +
                             std::to_string(geteuid()) + ", mode 755)"),
            std::string::npos)
      << refused.out;
  EXPECT_EQ(FileSize(open_dir + "/next-id"), -1);

  const std::string private_dir = dir + "/private", link = dir + "/link";
  ASSERT_EQ(mkdir(private_dir.c_str(), 0700), 0);
  ASSERT_EQ(symlink(private_dir.c_str(), link.c_str()), 0);
  refused = StartWithStorage(dir, link);
  EXPECT_NE(refused.status, 0) << refused.out;
  EXPECT_NE(refused.out.find("cannot open storage directory " + link + ": it is a symbolic link"),
            std::string::npos)
      << refused.out;
}

// Files of the storage directory are never followed through links: a snapshot file that is a
// link is skipped as damaged, and a link left where the collector writes is replaced, not
// written through.
TEST_F(StorageTest, LinksInTheStorageDirectoryAreNeverFollowed) {
  collector.Start();
  collector.Stop();
  const std::string victim = dir + "/victim";
  WriteFile(victim, "precious");
  ASSERT_EQ(symlink(victim.c_str(), (collector.storage + "/next-id.tmp").c_str()), 0);
  ASSERT_EQ(symlink(victim.c_str(), SnapshotFile(500).c_str()), 0);
  collector.Start();
  EXPECT_TRUE(
      Logged("skipping damaged stored snapshot " + SnapshotFile(500) + ": it is a symbolic link"))
      << collector.Log();
  Child child(collector.socket, "after-links");
  EXPECT_GT(StoredId(List(collector.socket), "after-links"), 500u);
  child.Finish();
  EXPECT_EQ(ReadFile(victim), "precious");
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

uint64_t RealtimeNs() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000u + static_cast<uint64_t>(ts.tv_nsec);
}

const Stored *Find(const Listing &listing, uint32_t id) {
  for (const Stored &s : listing.items) {
    if (s.id == id) return &s;
  }
  return nullptr;
}

// `heapdump list`'s columns: when each snapshot was taken, what the process had live then, and
// what it costs on disk, kept across restarts (they live in the file).
TEST_F(StorageTest, ListingsCarryTimeLiveTotalsAndSize) {
  collector.Start();
  Child child(collector.socket, nullptr);
  uint64_t before = RealtimeNs();
  uint32_t id = Store(child, "named");
  uint64_t after = RealtimeNs();
  child.Finish();
  ASSERT_NE(id, 0u);
  for (int restart = 0; restart < 2; restart++) {
    SCOPED_TRACE(restart ? "after a restart" : "as stored");
    Listing listing = List(collector.socket);
    const Stored *s = Find(listing, id);
    ASSERT_NE(s, nullptr);
    ASSERT_TRUE(s->has_totals);
    EXPECT_GE(s->taken_at_unix_ns, before);
    EXPECT_LE(s->taken_at_unix_ns, after);
    EXPECT_EQ(static_cast<off_t>(s->stored_bytes), FileSize(SnapshotFile(id)));
    auto snapshot = Download(collector.socket, id);
    ASSERT_EQ(snapshot->status, HD_OK) << snapshot->ra.error;
    const hd_snapshot *only = snapshot->only();
    ASSERT_NE(only, nullptr);
    uint64_t bytes = 0;
    for (size_t i = 0; i < only->allocation_count; i++) bytes += only->allocations[i].size;
    EXPECT_EQ(s->live_blocks, only->allocation_count);
    EXPECT_EQ(s->live_bytes, bytes);
    EXPECT_GE(s->live_blocks, 10u);  // alpha_leaks' ten blocks at least
    collector.Stop();
    collector.Start();
  }
}

// A file an older collector stored (its metadata without the totals) is still listed and
// served, with the totals absent rather than zero.
TEST_F(StorageTest, FilesWithoutTotalsAreListedWithoutThem) {
  collector.Start();
  Child child(collector.socket, nullptr);
  uint32_t id = Store(child, "old");
  child.Finish();
  ASSERT_NE(id, 0u);
  collector.Stop();
  const std::string whole = ReadFile(SnapshotFile(id));
  uint32_t meta_len;
  memcpy(&meta_len, whole.data() + 12, 4);
  heapdump_client_StoredSnapshot meta = heapdump_client_StoredSnapshot_init_zero;
  meta.has_snapshot_id = meta.has_snapshot_name = meta.has_process_koid = true;
  meta.has_process_name = true;
  meta.snapshot_id = id + 100;
  strcpy(meta.snapshot_name, "older");
  meta.process_koid = 42;
  strcpy(meta.process_name, "legacy");
  uint8_t buf[heapdump_client_StoredSnapshot_size];
  pb_ostream_t out = pb_ostream_from_buffer(buf, sizeof buf);
  ASSERT_TRUE(pb_encode(&out, heapdump_client_StoredSnapshot_fields, &meta));
  uint32_t new_len = static_cast<uint32_t>(out.bytes_written);
  std::string older = whole.substr(0, 12) + std::string(reinterpret_cast<char *>(&new_len), 4) +
                      std::string(reinterpret_cast<char *>(buf), new_len) +
                      whole.substr(16 + meta_len);
  WriteFile(SnapshotFile(id + 100), older);
  collector.Start();
  Listing listing = List(collector.socket);
  const Stored *s = Find(listing, id + 100);
  ASSERT_NE(s, nullptr) << collector.Log();
  EXPECT_FALSE(s->has_totals);
  EXPECT_EQ(s->name, "older");
  EXPECT_EQ(static_cast<off_t>(s->stored_bytes), FileSize(SnapshotFile(id + 100)));
  auto snapshot = Download(collector.socket, id + 100);
  ASSERT_EQ(snapshot->status, HD_OK) << snapshot->ra.error;
  EXPECT_EQ(Blocks(snapshot->only(), 100, "alpha_leaks").in_function, 10u);
}

// DeleteStoredSnapshot removes the file and the listing entry for good; unknown ids are
// refused; ids are never reused afterwards.
TEST_F(StorageTest, DeleteRemovesASnapshotForGood) {
  collector.Start();
  Child child(collector.socket, nullptr);
  uint32_t keep = Store(child, "keep"), gone = Store(child, "gone");
  ASSERT_NE(keep, 0u);
  ASSERT_NE(gone, 0u);
  CallResult deleted = Delete(collector.socket, gone);
  EXPECT_EQ(deleted.status, HD_OK);
  EXPECT_EQ(deleted.error, 0u);
  EXPECT_EQ(Names(), (std::set<std::string>{"keep"}));
  EXPECT_EQ(FileSize(SnapshotFile(gone)), -1);
  EXPECT_EQ(Download(collector.socket, gone)->error,
            Error(heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND));
  for (uint32_t id : {gone, 0u, 12345u}) {
    CallResult again = Delete(collector.socket, id);
    EXPECT_EQ(again.status, HD_OK) << id;
    EXPECT_EQ(again.error, Error(heapdump_client_CollectorError_STORED_SNAPSHOT_NOT_FOUND)) << id;
  }
  EXPECT_TRUE(Logged("deleted stored snapshot " + std::to_string(gone) + " "));
  collector.Stop();
  collector.Start();
  EXPECT_EQ(Names(), (std::set<std::string>{"keep"}));
  EXPECT_GT(Store(child, "next"), gone);
  child.Finish();
}

// GetProcessState: a registered process is running; once it exits, its exit snapshot's id is
// told; a pid that never registered is unknown, at once.
TEST_F(StorageTest, ProcessStateFollowsAProcessToItsExitSnapshot) {
  collector.Start();
  Child child(collector.socket, nullptr, /*exit_snapshot=*/true);
  pid_t pid = child.pid;
  ProcessStatus running = GetProcessState(collector.socket, pid);
  ASSERT_EQ(running.status, HD_OK);
  EXPECT_EQ(running.state, heapdump_client_ProcessState_PROCESS_STATE_RUNNING);
  EXPECT_FALSE(running.process_name.empty());
  child.Finish();
  ProcessStatus exited;
  for (int i = 0; i < 500; i++) {
    exited = GetProcessState(collector.socket, pid);
    if (exited.state != heapdump_client_ProcessState_PROCESS_STATE_RUNNING &&
        exited.state != heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_PENDING) {
      break;
    }
    usleep(10000);
  }
  EXPECT_EQ(exited.state, heapdump_client_ProcessState_PROCESS_STATE_EXIT_SNAPSHOT_STORED);
  EXPECT_EQ(exited.exit_snapshot_id, StoredId(List(collector.socket), "exit"));
  EXPECT_EQ(exited.process_name, running.process_name);
  // This test's own pid never registered.
  EXPECT_EQ(GetProcessState(collector.socket, getpid()).state,
            heapdump_client_ProcessState_PROCESS_STATE_UNKNOWN);
  EXPECT_EQ(GetProcessState(collector.socket, 0).error,
            Error(heapdump_client_CollectorError_PROCESS_SELECTOR_NO_MATCH));
}

// A store that cannot be written (here: a file-size limit, as a full disk would) is refused with
// the reason in the log, loses nothing stored before and leaves the collector serving; the next
// store, with room again, succeeds. The limit's SIGXFSZ used to kill the daemon.
TEST_F(StorageTest, AStoreThatCannotBeWrittenSaysWhyAndTheCollectorServesOn) {
  // The file-size limit below holds for the collector's log too: at the debug level, lines about
  // other tests' processes it finds could fill the log's first KiB before the error is written.
  collector.args = {"--log-level", "info"};
  collector.Start();
  Child child(collector.socket, "before");
  ASSERT_EQ(child.snapshot_rc, 0);
  struct rlimit tiny = {1024, RLIM_INFINITY};
  ASSERT_EQ(prlimit(collector.pid, RLIMIT_FSIZE, &tiny, nullptr), 0);
  EXPECT_EQ(child.Snapshot("too-big"), HEAPDUMP_ERROR_COLLECTOR_REFUSED);
  EXPECT_NE(collector.Log().find("could not store snapshot \"too-big\" of snapshot_child[" +
                                 std::to_string(child.pid) + "] in " + collector.storage + ": " +
                                 strerror(EFBIG)),
            std::string::npos)
      << collector.Log();
  struct rlimit room = {RLIM_INFINITY, RLIM_INFINITY};
  ASSERT_EQ(prlimit(collector.pid, RLIMIT_FSIZE, &room, nullptr), 0);
  EXPECT_EQ(child.Snapshot("after"), 0);
  Listing listing = List(collector.socket);
  EXPECT_NE(StoredId(listing, "before"), 0u);
  EXPECT_NE(StoredId(listing, "after"), 0u);
  EXPECT_EQ(StoredId(listing, "too-big"), 0u);
  child.Finish();
}

}  // namespace
}  // namespace hdtest
