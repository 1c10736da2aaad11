// The snapshot consistency promise, on a real program whose threads allocate and free without
// pause (growing its table) while snapshots are taken: every block
// live for the whole snapshot appears exactly once, and no block freed before the snapshot
// started appears. heap_workload's "churn" mode documents the sizes each kind of block uses.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness.h"

namespace hdtest {
namespace {

constexpr uint64_t kFreedEarlySize = 7777;
constexpr uint64_t kKeptMin = 1000, kKeptMax = 1999;

struct Kept {
  uint64_t address, size;
};

std::vector<Kept> ReadKept(const std::string &path) {
  std::vector<Kept> kept;
  std::ifstream in(path);
  std::string address;
  uint64_t size;
  while (in >> address >> size) kept.push_back({std::stoull(address, nullptr, 16), size});
  return kept;
}

class ConsistencyTest : public ::testing::Test {
 protected:
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
  Collector collector{dir};
  void SetUp() override { collector.Start(); }
};

// Checks one snapshot against the kept blocks; `freed` says which of them were freed before it.
void CheckSnapshot(const hd_snapshot *s, const std::vector<Kept> &kept,
                   const std::vector<bool> &freed, int round) {
  SCOPED_TRACE("snapshot " + std::to_string(round));
  ASSERT_NE(s, nullptr);
  std::map<uint64_t, uint64_t> seen;  // address -> size, of every allocation
  size_t duplicates = 0, freed_early = 0;
  for (size_t i = 0; i < s->allocation_count; i++) {
    const hd_snapshot_allocation &a = s->allocations[i];
    duplicates += !seen.emplace(a.address, a.size).second;
    freed_early += a.size == kFreedEarlySize;
  }
  EXPECT_EQ(duplicates, 0u);
  EXPECT_EQ(freed_early, 0u) << "blocks freed before the snapshot started appear";
  size_t missing = 0, resurrected = 0;
  for (size_t i = 0; i < kept.size(); i++) {
    auto it = seen.find(kept[i].address);
    bool present = it != seen.end() && it->second == kept[i].size;
    if (freed[i]) {
      resurrected += present;  // the address may be reused, but never with a kept size
    } else {
      missing += !present;
    }
  }
  EXPECT_EQ(missing, 0u) << "blocks live for the whole snapshot are missing";
  EXPECT_EQ(resurrected, 0u) << "blocks freed before the snapshot started appear";
}

TEST_F(ConsistencyTest, SnapshotsUnderConcurrentAllocationAreExact) {
  const std::string kept_path = dir + "/kept.txt";
  Workload workload(collector.socket, {"churn", kept_path});
  std::vector<Kept> kept = ReadKept(kept_path);
  ASSERT_EQ(kept.size(), 20000u);
  for (const Kept &k : kept) ASSERT_TRUE(k.size >= kKeptMin && k.size <= kKeptMax);
  std::vector<bool> freed(kept.size(), false);
  auto selector = ByPid(workload.pid);
  size_t largest = 0;
  // Snapshots take milliseconds: first let the churn threads build their live sets (checking
  // every snapshot on the way), so that the rounds below run against a table that is growing.
  for (int warm_up = 0; warm_up < 5000 && largest <= kept.size() + 10000; warm_up++) {
    auto result = TakeLiveSnapshot(collector.socket, &selector);
    ASSERT_EQ(result->status, HD_OK) << result->ra.error;
    ASSERT_EQ(result->error, 0u);
    CheckSnapshot(result->only(), kept, freed, -1 - warm_up);
    largest = std::max(largest, result->only()->allocation_count);
  }
  const int kRounds = 8;
  for (int round = 0; round < kRounds; round++) {
    if (round == kRounds / 2) {
      // From now on the odd kept blocks are gone, freed before the next snapshot starts.
      workload.program->Send("free-odd");
      ASSERT_EQ(workload.program->ReadLine(), "freed");
      for (size_t i = 1; i < kept.size(); i += 2) freed[i] = true;
    }
    auto result = TakeLiveSnapshot(collector.socket, &selector);
    ASSERT_EQ(result->status, HD_OK) << result->ra.error;
    ASSERT_EQ(result->error, 0u);
    CheckSnapshot(result->only(), kept, freed, round);
    largest = std::max(largest, result->only()->allocation_count);
  }
  workload.program->Send("stop");
  EXPECT_EQ(workload.program->ReadLine(), "stopped");
  // The churn really ran: its threads hold tens of thousands of blocks at a time.
  EXPECT_GT(largest, kept.size() + 10000);
  // Once quiet, a snapshot is exact: the kept even blocks and the C library's few.
  auto quiet = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(quiet->status, HD_OK) << quiet->ra.error;
  CheckSnapshot(quiet->only(), kept, freed, kRounds);
  EXPECT_LT(quiet->only()->allocation_count, kept.size() / 2 + 100);
}

}  // namespace
}  // namespace hdtest
