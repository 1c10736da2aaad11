// Unit tests of the table writer (instrumentation/src/alloc_table.c, res_table.c) read back through
// the collector's reader (collector/table_reader.c), both linked directly.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <semaphore.h>
#include <signal.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

extern "C" {
#include "tables.h"
}
#include "table_reader.h"

namespace {

hd_alloc_info Info(uint64_t addr, uint64_t size, uint32_t stack = 0) {
  hd_alloc_info i{};
  i.address = addr;
  i.size = size;
  i.timestamp = 1;
  i.stack_key = stack;
  return i;
}

// The writer erases and replaces the record in the node a block's tag names (record.c); here
// each thread remembers which node it gave each address, by table, as the tags would.
thread_local std::map<std::pair<const hd_alloc_table *, uint64_t>, uint32_t> tl_nodes;

hd_insert_result Insert(hd_alloc_table *t, hd_writer_thread *w, const hd_alloc_info &info) {
  uint32_t index = HD_NO_NODE;
  const hd_insert_result r = hd_alloc_table_insert(t, w, &info, &index);
  if (r == HD_INSERT_NEW) tl_nodes[{t, info.address}] = index;
  return r;
}

// The node that records address, found by a scan of the table (the library has no index: a
// block's tag names its node).
uint32_t ScanFor(const hd_alloc_table *t, uint64_t address) {
  const uint32_t high_water = __atomic_load_n(&t->hdr->node_high_water, __ATOMIC_ACQUIRE);
  for (uint32_t idx = 0; address != 0 && idx < high_water; idx++) {
    const uint64_t word = __atomic_load_n(&t->nodes[idx].address_word, __ATOMIC_ACQUIRE);
    if (hd_node_address(word) == address) return idx;
  }
  return HD_NO_NODE;
}

// The node this thread gave address, or (for another thread's block) the one a scan finds.
uint32_t NodeOf(hd_alloc_table *t, uint64_t address) {
  auto it = tl_nodes.find({t, address});
  return it != tl_nodes.end() ? it->second : ScanFor(t, address);
}

bool Erase(hd_alloc_table *t, hd_writer_thread *w, uint64_t address, hd_alloc_info *out) {
  const uint32_t index = NodeOf(t, address);
  if (index == HD_NO_NODE || !hd_alloc_table_erase(t, w, index, address, out)) return false;
  tl_nodes.erase({t, address});
  return true;
}

bool Replace(hd_alloc_table *t, const hd_alloc_info &info, hd_alloc_info *old) {
  const uint32_t index = NodeOf(t, info.address);
  return index != HD_NO_NODE && hd_alloc_table_replace(t, index, &info, old);
}

// Whether a copy sorted by address holds an address twice.
bool HasDouble(const std::vector<hd_live_block> &sorted) {
  return std::adjacent_find(sorted.begin(), sorted.end(),
                            [](const hd_live_block &x, const hd_live_block &y) {
                              return x.address == y.address;
                            }) != sorted.end();
}

std::vector<hd_live_block> Snapshot(int fd, hd_read_status *status = nullptr) {
  hd_alloc_reader *r = nullptr;
  hd_read_status st = hd_alloc_reader_open(fd, &r);
  std::vector<hd_live_block> out;
  if (st == HD_READ_OK) {
    hd_live_block *b = nullptr;
    size_t n = 0;
    st = hd_alloc_reader_snapshot(r, &b, &n);
    if (st == HD_READ_OK) out.assign(b, b + n);
    free(b);
    hd_alloc_reader_close(r);
  }
  if (status)
    *status = st;
  else
    EXPECT_EQ(st, HD_READ_OK) << hd_read_status_str(st);
  return out;
}

struct AllocTable : ::testing::Test {
  hd_alloc_table t{};
  void SetUp() override { ASSERT_EQ(hd_alloc_table_create(&t, 64 << 20, "test-alloc"), 0); }
  void TearDown() override {
    hd_alloc_table_destroy(&t);
    tl_nodes.clear();
  }
};

// The writer holding the slot locks (here all of them, as fork and a snapshot copy do) is
// preempted on its CPU by a higher-priority SCHED_FIFO writer that needs one. The waiter must
// sleep so that the holder runs and unlocks: a waiter that spins or yields never lets a
// lower-priority holder run again, and the child (which checks this under an alarm) would hang.
TEST_F(AllocTable, AWaiterSleepsSoThatAPreemptedHolderRuns) {
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(20);
    cpu_set_t one_cpu;
    CPU_ZERO(&one_cpu);
    CPU_SET(sched_getcpu(), &one_cpu);
    if (sched_setaffinity(0, sizeof(one_cpu), &one_cpu) != 0) _exit(3);
    static sem_t go;
    sem_init(&go, 0, 0);
    static hd_alloc_table *table;
    table = &t;
    auto start = [](int priority, void *(*body)(void *), pthread_t *thread) {
      pthread_attr_t attr;
      pthread_attr_init(&attr);
      pthread_attr_setinheritsched(&attr, PTHREAD_EXPLICIT_SCHED);
      pthread_attr_setschedpolicy(&attr, SCHED_FIFO);
      struct sched_param param = {};
      param.sched_priority = priority;
      pthread_attr_setschedparam(&attr, &param);
      int rc = pthread_create(thread, &attr, body, nullptr);
      pthread_attr_destroy(&attr);
      return rc;
    };
    pthread_t high, low;
    int rc = start(
        20,
        [](void *) -> void * {
          sem_wait(&go);  // wakes while the holder has every slot locked, and preempts it
          hd_alloc_info info = Info(0x5000, 8);
          return reinterpret_cast<void *>(Insert(table, nullptr, info));
        },
        &high);
    if (rc == EPERM) _exit(77);
    if (rc != 0) _exit(4);
    rc = start(
        10,
        [](void *) -> void * {
          hd_alloc_table_lock_all(table);
          sem_post(&go);
          hd_alloc_table_unlock_all(table);  // runs only once the waiter sleeps
          return nullptr;
        },
        &low);
    if (rc != 0) _exit(5);
    void *inserted = nullptr;
    pthread_join(low, nullptr);
    pthread_join(high, &inserted);
    _exit(reinterpret_cast<intptr_t>(inserted) == HD_INSERT_NEW ? 0 : 6);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
    GTEST_SKIP() << "SCHED_FIFO is not permitted here (needs root or RLIMIT_RTPRIO)";
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "status " << status
      << (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM ? ": hung" : "");
}

TEST_F(AllocTable, InsertEraseTwice) {
  for (int round = 0; round < 2; round++) {
    for (uint64_t a = 1; a <= 3; a++)
      ASSERT_EQ(Insert(&t, nullptr, Info(a * 16, a)), HD_INSERT_NEW);
    auto blocks = Snapshot(t.memfd.fd);
    ASSERT_EQ(blocks.size(), 3u);
    EXPECT_EQ(blocks[0].address, 16u);
    EXPECT_EQ(blocks[2].size, 3u);
    hd_alloc_info out;
    EXPECT_TRUE(Erase(&t, nullptr, 32, &out));
    EXPECT_EQ(out.size, 2u);
    EXPECT_FALSE(Erase(&t, nullptr, 32, &out));
    EXPECT_EQ(Snapshot(t.memfd.fd).size(), 2u);
    EXPECT_TRUE(Erase(&t, nullptr, 16, nullptr));
    EXPECT_TRUE(Erase(&t, nullptr, 48, nullptr));
    EXPECT_EQ(Snapshot(t.memfd.fd).size(), 0u);
  }
  uint64_t blocks, bytes;
  hd_alloc_table_sum_locked(&t, 0, &blocks, &bytes);
  EXPECT_EQ(blocks, 0u);
}

// A record is erased or replaced only through the node that holds its address: a node index
// that names another block's node (a tag the program overwrote) changes nothing.
TEST_F(AllocTable, OnlyTheNodeHoldingAnAddressChangesIt) {
  uint32_t first = HD_NO_NODE, second = HD_NO_NODE;
  ASSERT_EQ(hd_alloc_table_insert(&t, nullptr, &(const hd_alloc_info &)Info(64, 1), &first),
            HD_INSERT_NEW);
  ASSERT_EQ(hd_alloc_table_insert(&t, nullptr, &(const hd_alloc_info &)Info(128, 2), &second),
            HD_INSERT_NEW);
  ASSERT_NE(first, second);
  hd_alloc_info out;
  EXPECT_FALSE(hd_alloc_table_erase(&t, nullptr, second, 64, &out));
  EXPECT_FALSE(hd_alloc_table_erase(&t, nullptr, t.hdr->node_capacity + 3, 64, &out));
  EXPECT_FALSE(hd_alloc_table_replace(&t, second, &(const hd_alloc_info &)Info(64, 9), nullptr));
  EXPECT_EQ(ScanFor(&t, 64), first);
  EXPECT_EQ(ScanFor(&t, 128), second);
  EXPECT_EQ(ScanFor(&t, 192), HD_NO_NODE);
  EXPECT_EQ(ScanFor(&t, 0), HD_NO_NODE);
  auto b = Snapshot(t.memfd.fd);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].size, 1u);
  EXPECT_EQ(b[1].size, 2u);
  ASSERT_TRUE(hd_alloc_table_erase(&t, nullptr, first, 64, &out));
  EXPECT_EQ(out.size, 1u);
  EXPECT_EQ(ScanFor(&t, 64), HD_NO_NODE);
}

// A node packs the address and size into 48 bits each and the time into an offset from the
// header's time_base: every field a reader and the free path get back is the one recorded, up
// to those limits; past them a block is refused, never recorded wrong.
TEST_F(AllocTable, NodeFieldsRoundTripToTheirLimits) {
  t.hdr->time_base = 5000000000u;
  const uint64_t top = (uint64_t{1} << 48) - 16;
  struct Case {
    uint64_t address, size, timestamp, want_timestamp;
    uint32_t align;
  };
  const Case cases[] = {
      {0x10000, 1, 5000000001u, 5000000001u, 0},
      {0x20000, (uint64_t{5} << 32) + 7, 7000000000u, 7000000000u, 12},
      {top, (uint64_t{1} << 48) - 1, 5000000000u, 5000000000u, 63},
      {0x30000, 0, 4000000000u, 5000000000u, 0},  // before the base: the base
      {0x40000, 3, 5000000000u + (uint64_t{1} << 57), 5000000000u + (uint64_t{1} << 56) - 1, 0},
  };
  for (const Case &c : cases) {
    hd_alloc_info i = Info(c.address, c.size, 7);
    i.timestamp = c.timestamp;
    i.flags = c.align;
    i.thread_key = 9;
    ASSERT_EQ(Insert(&t, nullptr, i), HD_INSERT_NEW) << c.address;
  }
  auto blocks = Snapshot(t.memfd.fd);
  ASSERT_EQ(blocks.size(), std::size(cases));
  for (const Case &c : cases) {
    auto it = std::find_if(blocks.begin(), blocks.end(),
                           [&](const hd_live_block &b) { return b.address == c.address; });
    ASSERT_NE(it, blocks.end()) << c.address;
    EXPECT_EQ(it->size, c.size);
    EXPECT_EQ(it->timestamp, c.want_timestamp);
    EXPECT_EQ(it->flags, c.align);
    EXPECT_EQ(it->stack_key, 7u);
    EXPECT_EQ(it->thread_key, 9u);
    hd_alloc_info out;
    ASSERT_TRUE(Erase(&t, nullptr, c.address, &out));
    EXPECT_EQ(out.size, c.size);
    EXPECT_EQ(out.flags, c.align);
    EXPECT_EQ(out.timestamp, c.want_timestamp);
  }
  const hd_alloc_info too_high = Info(uint64_t{1} << 48, 1),
                      too_big = Info(0x50000, uint64_t{1} << 48);
  EXPECT_EQ(Insert(&t, nullptr, too_high), HD_INSERT_UNREPRESENTABLE);
  EXPECT_EQ(Insert(&t, nullptr, too_big), HD_INSERT_UNREPRESENTABLE);
  ASSERT_EQ(Insert(&t, nullptr, Info(0x50000, 1)), HD_INSERT_NEW);
  EXPECT_FALSE(Replace(&t, too_big, nullptr));
  auto left = Snapshot(t.memfd.fd);
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].size, 1u);
}

// A snapshot copy keeps the times: it carries the live table's time_base.
TEST_F(AllocTable, CopyKeepsTheTimeBase) {
  t.hdr->time_base = 123456789u;
  hd_alloc_info i = Info(0x10000, 1);
  i.timestamp = 223456789u;
  ASSERT_EQ(Insert(&t, nullptr, i), HD_INSERT_NEW);
  hd_alloc_table copy;
  hd_alloc_table_lock_all(&t);
  ASSERT_EQ(hd_alloc_table_clone_locked(&t, &copy, 0, "heapdump-test-copy"), 0);
  hd_alloc_table_unlock_all(&t);
  auto b = Snapshot(copy.memfd.fd);
  ASSERT_EQ(b.size(), 1u);
  EXPECT_EQ(b[0].timestamp, 223456789u);
  hd_alloc_table_destroy(&copy);
}

TEST_F(AllocTable, ManyRecordsAreReadBackEachOnce) {
  const uint64_t n = 200000;
  for (uint64_t i = 0; i < n; i++)
    ASSERT_EQ(Insert(&t, nullptr, Info(0x10000 + i * 16, i)), HD_INSERT_NEW);
  auto b = Snapshot(t.memfd.fd);
  ASSERT_EQ(b.size(), n);
  for (uint64_t i = 0; i < n; i++) ASSERT_EQ(b[i].size, i);
}

TEST(AllocTableCap, FullIsCountedNotFatalAndFreedNodesAreReused) {
  hd_alloc_table t{};
  ASSERT_EQ(hd_alloc_table_create(&t, 0, "test-small"), 0);  // clamped to the minimum
  uint32_t cap = t.hdr->node_capacity;
  ASSERT_GT(cap, 0u);
  for (uint32_t i = 0; i < cap; i++)
    ASSERT_EQ(Insert(&t, nullptr, Info(16 * (i + 1), 1)), HD_INSERT_NEW);
  EXPECT_EQ(Insert(&t, nullptr, Info(16 * (cap + 1), 1)), HD_INSERT_FULL);
  EXPECT_TRUE(Erase(&t, nullptr, 16, nullptr));
  EXPECT_EQ(Insert(&t, nullptr, Info(16 * (cap + 1), 1)), HD_INSERT_NEW);
  EXPECT_EQ(Snapshot(t.memfd.fd).size(), cap);
  hd_alloc_table_destroy(&t);
}

// The snapshot promise under concurrent writers: stable blocks appear exactly once in every
// snapshot, including one whose record is replaced in place all the time (realloc in place),
// and erased-then-reinserted churn never shows a duplicate.
TEST_F(AllocTable, ConcurrentSnapshotsSeeStableBlocksExactlyOnce) {
  const uint64_t kStable = 5000;
  for (uint64_t i = 0; i < kStable; i++)
    ASSERT_EQ(Insert(&t, nullptr, Info(0x100000 + i * 32, 1)), HD_INSERT_NEW);
  std::atomic<bool> stop{false};
  std::vector<std::thread> writers;
  for (int w = 0; w < 3; w++) {
    writers.emplace_back([&, w] {
      uint64_t base = 0x10000000 + (uint64_t)w * 0x1000000, k = 0;
      hd_writer_thread own{};  // two writers keep node caches, one uses the shared free list
      hd_writer_thread *ws = w == 0 ? nullptr : &own;
      while (!stop) {
        for (uint64_t i = 0; i < 3000; i++)
          EXPECT_EQ(Insert(&t, ws, Info(base + i * 16, 2)), HD_INSERT_NEW);
        for (uint64_t i = 0; i < 3000; i++) EXPECT_TRUE(Erase(&t, ws, base + i * 16, nullptr));
        hd_alloc_info r = Info(0x100000, 100 + (k++ % 7));  // in-place replace of a stable one
        EXPECT_TRUE(Replace(&t, r, nullptr));
      }
    });
  }
  for (int round = 0; round < 40; round++) {
    auto b = Snapshot(t.memfd.fd);
    uint64_t stable = 0;
    for (auto &x : b) stable += x.address >= 0x100000 && x.address < 0x100000 + kStable * 32;
    ASSERT_EQ(stable, kStable) << "round " << round;
    ASSERT_FALSE(HasDouble(b)) << "round " << round;
  }
  stop = true;
  for (auto &w : writers) w.join();
}

// A block freed and allocated again at its address can land in another node while a copy runs,
// and be met twice. Here each writer's two addresses trade two nodes far apart (other slots) as
// fast as it can: a free puts its node on the writer's own cache, whose top the next insert
// takes. Without the reader settling doubles, copies hold an address twice within a few rounds.
TEST_F(AllocTable, AnAddressMovingBetweenNodesIsCopiedAtMostOnce) {
  const uint64_t kStable = 3000;
  for (uint64_t i = 0; i < kStable; i++)
    ASSERT_EQ(Insert(&t, nullptr, Info(0x100000 + i * 32, 1)), HD_INSERT_NEW);
  std::atomic<bool> stop{false};
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; w++) {
    writers.emplace_back([&, w] {
      const uint64_t a = 0x20000000 + (uint64_t)w * 0x100000, b = a + 0x100;
      hd_writer_thread own{};
      EXPECT_EQ(Insert(&t, &own, Info(a, 1)), HD_INSERT_NEW);
      for (uint64_t i = 1; i <= 4 * HD_NODES_PER_SLOT; i++)  // kept: b's node is slots away
        EXPECT_EQ(Insert(&t, &own, Info(a + 0x1000 + i * 16, 3)), HD_INSERT_NEW);
      EXPECT_EQ(Insert(&t, &own, Info(b, 2)), HD_INSERT_NEW);
      while (!stop) {
        EXPECT_TRUE(Erase(&t, &own, a, nullptr));
        EXPECT_TRUE(Erase(&t, &own, b, nullptr));  // on top: the next insert, of a, takes it
        EXPECT_EQ(Insert(&t, &own, Info(a, 1)), HD_INSERT_NEW);
        EXPECT_EQ(Insert(&t, &own, Info(b, 2)), HD_INSERT_NEW);
      }
    });
  }
  for (int round = 0; round < 300; round++) {
    auto b = Snapshot(t.memfd.fd);
    std::map<uint64_t, int> seen;
    for (auto &x : b) seen[x.address]++;
    for (auto &[address, times] : seen)
      ASSERT_EQ(times, 1) << std::hex << address << std::dec << " round " << round;
    uint64_t stable = 0;
    for (auto &x : b) stable += x.address >= 0x100000 && x.address < 0x100000 + kStable * 32;
    ASSERT_EQ(stable, kStable) << "round " << round;
  }
  stop = true;
  for (auto &w : writers) w.join();
}

// Writers never wait for a reader: a reader process stopped (SIGSTOP) in the middle of its
// copies, thirty times, holds up no insert, erase or in-place replace. A writer that waited for
// the reader would not finish its round while the reader is stopped; the deadline below only
// turns such a hang into a failure.
TEST_F(AllocTable, WritersNeverWaitForAStoppedReader) {
  const uint64_t kStable = 20000;
  for (uint64_t i = 0; i < kStable; i++)
    ASSERT_EQ(Insert(&t, nullptr, Info(0x100000 + i * 32, 1)), HD_INSERT_NEW);
  pid_t reader = fork();
  ASSERT_GE(reader, 0);
  if (reader == 0) {
    for (;;) {  // copies until killed
      hd_alloc_reader *r = nullptr;
      if (hd_alloc_reader_open(t.memfd.fd, &r) != HD_READ_OK) _exit(3);
      hd_live_block *b = nullptr;
      size_t n = 0;
      if (hd_alloc_reader_snapshot(r, &b, &n) == HD_READ_OK) free(b);
      hd_alloc_reader_close(r);
    }
  }
  hd_writer_thread own{};
  uint64_t grown = 0;
  for (int round = 0; round < 30; round++) {
    usleep(300 + (unsigned)round * 97 % 1500);  // somewhere in a copy
    ASSERT_EQ(kill(reader, SIGSTOP), 0);
    int status = 0;
    ASSERT_EQ(waitpid(reader, &status, WUNTRACED), reader);
    ASSERT_TRUE(WIFSTOPPED(status)) << "the reader ended: " << status;
    std::atomic<bool> done{false};
    std::thread writer([&] {
      const uint64_t base = 0x10000000 + (uint64_t)round * 0x100000;
      for (uint64_t i = 0; i < 4000; i++)
        EXPECT_EQ(Insert(&t, &own, Info(base + i * 16, 2)), HD_INSERT_NEW);
      for (uint64_t i = 0; i < 4000; i += 2) EXPECT_TRUE(Erase(&t, &own, base + i * 16, nullptr));
      hd_alloc_info r = Info(0x100000, 100 + (uint64_t)round);
      EXPECT_TRUE(Replace(&t, r, nullptr));
      done = true;
    });
    for (int waited = 0; waited < 60000 && !done; waited++) usleep(1000);
    const bool finished = done;
    kill(reader, SIGCONT);  // lets a writer that waited for it go on, so that it can be joined
    writer.join();
    ASSERT_TRUE(finished) << "round " << round << ": the writer waited for the stopped reader";
    grown += 2000;
  }
  kill(reader, SIGKILL);
  waitpid(reader, nullptr, 0);
  EXPECT_EQ(Snapshot(t.memfd.fd).size(), kStable + grown);
}

// Four writers insert and erase, reusing nodes through their caches and the shared free list,
// under a reader: every copy holds the stable blocks once, and at the end exactly the blocks
// that were never erased are recorded, each once.
TEST_F(AllocTable, ManyWritersAndAReaderKeepEveryRecordOnce) {
  const uint64_t kStable = 2000, kPerWriter = 120000;
  for (uint64_t i = 0; i < kStable; i++)
    ASSERT_EQ(Insert(&t, nullptr, Info(0x100000 + i * 32, 1)), HD_INSERT_NEW);
  std::atomic<int> running{4};
  std::vector<std::thread> writers;
  for (int w = 0; w < 4; w++) {
    writers.emplace_back([&, w] {
      hd_writer_thread own{};
      hd_writer_thread *ws = w == 0 ? nullptr : &own;  // one writer uses the shared free list
      uint64_t base = 0x10000000 + (uint64_t)w * 0x10000000;
      for (uint64_t i = 0; i < kPerWriter; i++) {
        EXPECT_EQ(Insert(&t, ws, Info(base + i * 16, i)), HD_INSERT_NEW);
        // Every odd block is freed two inserts later, so erases and reused nodes run along.
        if (i >= 2 && (i - 2) % 2 == 1) {
          EXPECT_TRUE(Erase(&t, ws, base + (i - 2) * 16, nullptr));
        }
      }
      running--;
    });
  }
  while (running > 0) {
    auto b = Snapshot(t.memfd.fd);
    uint64_t stable = 0;
    for (auto &x : b) stable += x.address >= 0x100000 && x.address < 0x100000 + kStable * 32;
    ASSERT_EQ(stable, kStable);
    ASSERT_FALSE(HasDouble(b));
  }
  for (auto &w : writers) w.join();
  auto b = Snapshot(t.memfd.fd);
  std::set<uint64_t> want;
  for (uint64_t i = 0; i < kStable; i++) want.insert(0x100000 + i * 32);
  for (uint64_t w = 0; w < 4; w++)
    for (uint64_t i = 0; i < kPerWriter; i++)
      if (i % 2 == 0 || i + 2 >= kPerWriter) want.insert(0x10000000 + w * 0x10000000 + i * 16);
  std::set<uint64_t> got;
  for (auto &x : b) got.insert(x.address);
  EXPECT_EQ(got.size(), b.size());
  EXPECT_TRUE(got == want) << got.size() << " recorded, " << want.size() << " expected";
}

// Resident kilobytes of this process's read-only shared mappings of memfd `name` (the reader's;
// the writer's mapping is read-write), from /proc/self/smaps.
uint64_t ReaderResidentKb(const std::string &name) {
  FILE *f = fopen("/proc/self/smaps", "r");
  if (!f) return UINT64_MAX;
  char line[512];
  bool in_reader = false;
  uint64_t kb = 0;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    char perms[8];
    if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) == 3) {
      in_reader = strcmp(perms, "r--s") == 0 && strstr(line, ("/memfd:" + name).c_str()) != nullptr;
      continue;
    }
    unsigned long v;
    if (in_reader && sscanf(line, "Rss: %lu kB", &v) == 1) kb += v;
  }
  fclose(f);
  return kb;
}

TEST_F(AllocTable, ReaderReleasesItsPagesAndReadsTheSameAfterwards) {
  for (uint64_t i = 0; i < 100000; i++)
    ASSERT_EQ(Insert(&t, nullptr, Info(0x10000 + i * 16, i)), HD_INSERT_NEW);
  hd_alloc_reader *r = nullptr;
  ASSERT_EQ(hd_alloc_reader_open(t.memfd.fd, &r), HD_READ_OK);
  for (int pass = 0; pass < 2; pass++) {
    hd_live_block *b = nullptr;
    size_t n = 0;
    ASSERT_EQ(hd_alloc_reader_snapshot(r, &b, &n), HD_READ_OK);
    EXPECT_EQ(n, 100000u);
    for (size_t i = 0; i < n; i++) ASSERT_EQ(b[i].size, i);
    free(b);
    EXPECT_GT(ReaderResidentKb("test-alloc"), 3000u)
        << "pass " << pass;  // 100,000 nodes: 3,125 KiB
    hd_alloc_reader_release_pages(r);
    EXPECT_EQ(ReaderResidentKb("test-alloc"), 0u) << "pass " << pass;
  }
  hd_alloc_reader_close(r);
}

TEST_F(AllocTable, SnapshotCopyIsFrozenAndSealed) {
  for (uint64_t i = 0; i < 10; i++)
    ASSERT_EQ(Insert(&t, nullptr, Info(16 * (i + 1), i)), HD_INSERT_NEW);
  hd_alloc_table snap{};
  hd_alloc_table_lock_all(&t);
  ASSERT_EQ(hd_alloc_table_clone_locked(&t, &snap, 0, "test-snap"), 0);
  hd_alloc_table_unlock_all(&t);
  ASSERT_EQ(hd_alloc_table_freeze(&snap), 0);
  EXPECT_TRUE(Erase(&t, nullptr, 16, nullptr));  // the copy does not change
  EXPECT_EQ(Snapshot(snap.memfd.fd).size(), 10u);
  EXPECT_TRUE(fcntl(snap.memfd.fd, F_GET_SEALS) & F_SEAL_WRITE);
  hd_alloc_reader *r;
  ASSERT_EQ(hd_alloc_reader_open(snap.memfd.fd, &r), HD_READ_OK);
  hd_alloc_table_info info;
  ASSERT_EQ(hd_alloc_reader_info(r, &info), HD_READ_OK);
  EXPECT_TRUE(info.flags & HD_ALLOC_FLAG_SNAPSHOT);
  hd_alloc_reader_close(r);
  hd_alloc_table_destroy(&snap);
}

TEST_F(AllocTable, ReaderRejectsCorruption) {
  uint32_t index = HD_NO_NODE;
  for (uint64_t i = 0; i < 4; i++)
    ASSERT_EQ(
        hd_alloc_table_insert(&t, nullptr, &(const hd_alloc_info &)Info(16 * (i + 1), i), &index),
        HD_INSERT_NEW);
  hd_read_status st;
  // A high-water mark past the capacity reads no node beyond it.
  const uint32_t high_water = t.hdr->node_high_water;
  t.hdr->node_high_water = t.hdr->node_capacity + 5;
  EXPECT_EQ(Snapshot(t.memfd.fd, &st).size(), 4u);
  EXPECT_EQ(st, HD_READ_OK);
  t.hdr->node_high_water = high_water;
  // A slot left locked forever: bounded wait, then BUSY.
  t.seq[hd_node_slot(index)] |= 1;
  Snapshot(t.memfd.fd, &st);
  EXPECT_EQ(st, HD_READ_ERR_BUSY);
  t.seq[hd_node_slot(index)]++;
  // Header damage.
  t.hdr->nodes_offset = t.size;
  Snapshot(t.memfd.fd, &st);
  EXPECT_EQ(st, HD_READ_ERR_BAD_SIZE);
  t.hdr->version = 99;
  Snapshot(t.memfd.fd, &st);
  EXPECT_EQ(st, HD_READ_ERR_BAD_VERSION);
  t.hdr->magic = 0;
  Snapshot(t.memfd.fd, &st);
  EXPECT_EQ(st, HD_READ_ERR_BAD_MAGIC);
}

TEST(Reader, RejectsUnsealedAndTinyFiles) {
  int fd = memfd_create("plain", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 1 << 20), 0);
  hd_alloc_reader *r;
  EXPECT_EQ(hd_alloc_reader_open(fd, &r), HD_READ_ERR_NOT_SEALED);
  close(fd);
  fd = memfd_create("tiny", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(fd, 100), 0);
  ASSERT_EQ(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  EXPECT_EQ(hd_alloc_reader_open(fd, &r), HD_READ_ERR_BAD_SIZE);
  hd_res_reader *rr;
  EXPECT_EQ(hd_res_reader_open(fd, &rr), HD_READ_ERR_BAD_SIZE);
  close(fd);
  EXPECT_EQ(hd_alloc_reader_open(-1, &r), HD_READ_ERR_ARG);
}

struct ResTable : ::testing::Test {
  hd_res_table t{};
  hd_res_reader *r = nullptr;
  void SetUp() override {
    ASSERT_EQ(hd_res_table_create(&t, 1 << 20, "test-res"), 0);
    ASSERT_EQ(hd_res_reader_open(t.memfd.fd, &r), HD_READ_OK);
  }
  void TearDown() override {
    hd_res_reader_close(r);
    hd_res_table_destroy(&t);
  }
};

TEST_F(ResTable, StackTracesAreDeduplicatedAndRoundTrip) {
  std::vector<uint64_t> a = {0x7f0000001234, 0x7f0000001000, 0x401000, 0xffffffffffffffff, 0};
  std::vector<uint64_t> b = {0x401000};
  uint32_t ka = hd_res_intern_stack(&t, a.data(), (unsigned)a.size(), 0);
  uint32_t kb = hd_res_intern_stack(&t, b.data(), 1, 0);
  ASSERT_NE(ka, 0u);
  ASSERT_NE(kb, 0u);
  EXPECT_NE(ka, kb);
  EXPECT_EQ(hd_res_intern_stack(&t, a.data(), (unsigned)a.size(), 0), ka);
  EXPECT_EQ(hd_res_intern_stack(&t, a.data(), 4, 0), hd_res_intern_stack(&t, a.data(), 4, 0));
  EXPECT_NE(hd_res_intern_stack(&t, a.data(), 4, 0), ka);
  // A trace cut at the frame limit is not the whole trace with the same frames.
  uint32_t cut = hd_res_intern_stack(&t, a.data(), 4, HD_STACK_TRUNCATED);
  EXPECT_NE(cut, hd_res_intern_stack(&t, a.data(), 4, 0));
  EXPECT_EQ(cut, hd_res_intern_stack(&t, a.data(), 4, HD_STACK_TRUNCATED));
  // The hooks pass the fingerprint they computed for their own cache: the same trace, the same
  // key, whichever way it is interned.
  EXPECT_EQ(hd_res_intern_stack_print(&t, a.data(), (unsigned)a.size(), 0,
                                      hd_trace_fingerprint(a.data(), (unsigned)a.size(), 0)),
            ka);
  EXPECT_EQ(hd_res_intern_stack_print(&t, a.data(), 4, HD_STACK_TRUNCATED,
                                      hd_trace_fingerprint(a.data(), 4, HD_STACK_TRUNCATED)),
            cut);
  // Many distinct traces, each interned twice.
  std::set<uint32_t> keys;
  for (uint64_t i = 0; i < 2000; i++) {
    uint64_t f[3] = {i, i * 7919, 0x400000 + i};
    uint32_t k = hd_res_intern_stack(&t, f, 3, 0);
    ASSERT_EQ(hd_res_intern_stack(&t, f, 3, 0), k);
    keys.insert(k);
  }
  EXPECT_EQ(keys.size(), 2000u);
  hd_res_count_alloc(&t, nullptr, ka, 1, 100, 0);
  hd_res_count_alloc(&t, nullptr, ka, 1, 50, 0);
  hd_res_count_temporary(&t, nullptr, ka, 1);
  uint64_t frames[64];
  hd_trace_counters counters{};
  size_t n;
  ASSERT_EQ(hd_res_reader_stack(r, ka, frames, 64, &n, &counters, nullptr), HD_READ_OK);
  ASSERT_EQ(n, a.size());
  for (size_t i = 0; i < n; i++) EXPECT_EQ(frames[i], a[i]);
  EXPECT_EQ(counters.allocated_blocks, 2u);
  EXPECT_EQ(counters.allocated_bytes, 150u);
  EXPECT_EQ(counters.temporary_blocks, 1u);
  bool truncated = true;
  ASSERT_EQ(hd_res_reader_stack(r, ka, frames, 64, &n, nullptr, &truncated), HD_READ_OK);
  EXPECT_FALSE(truncated);
  ASSERT_EQ(hd_res_reader_stack(r, cut, frames, 64, &n, nullptr, &truncated), HD_READ_OK);
  EXPECT_TRUE(truncated);
  EXPECT_EQ(n, 4u);
  EXPECT_EQ(hd_res_reader_stack(r, ka, frames, 2, &n, nullptr, nullptr), HD_READ_ERR_NO_SPACE);
  EXPECT_EQ(hd_res_reader_stack(r, ka + 8, frames, 64, &n, nullptr, nullptr),
            HD_READ_ERR_NOT_FOUND);
  EXPECT_EQ(hd_res_reader_stack(r, 3, frames, 64, &n, nullptr, nullptr), HD_READ_ERR_NOT_FOUND);
  EXPECT_EQ(hd_res_reader_stack(r, 1u << 30, frames, 64, &n, nullptr, nullptr),
            HD_READ_ERR_NOT_FOUND);
  // Damage the varint stream: the reader must notice.
  auto *rec = (hd_rec_stack *)(t.base + kb);
  rec->frame_count = 3;
  EXPECT_EQ(hd_res_reader_stack(r, kb, frames, 64, &n, nullptr, nullptr), HD_READ_ERR_CORRUPT);
  rec->frame_count = 1;
  rec->encoded_len = 100000;
  EXPECT_EQ(hd_res_reader_stack(r, kb, frames, 64, &n, nullptr, nullptr), HD_READ_ERR_CORRUPT);
}

TEST_F(ResTable, ThreadsRegionsStatsAndIteration) {
  uint32_t th = hd_res_add_thread(&t, 42, "main-thread", 7);
  hd_region_info ri{};
  ri.address = 0x400000;
  ri.size = 0x1000;
  ri.file_offset = 0x1000;
  ri.vaddr = 0x401000;
  ri.build_id_len = 20;
  for (int i = 0; i < 20; i++) ri.build_id[i] = (uint8_t)i;
  ri.name = "/usr/bin/thing";
  uint32_t rg = hd_res_add_region(&t, &ri);
  ASSERT_NE(th, 0u);
  ASSERT_NE(rg, 0u);
  hd_thread_info ti;
  ASSERT_EQ(hd_res_reader_thread(r, th, &ti), HD_READ_OK);
  EXPECT_EQ(ti.tid, 42u);
  EXPECT_STREQ(ti.name, "main-thread");
  EXPECT_EQ(hd_res_reader_thread(r, rg, &ti), HD_READ_ERR_NOT_FOUND);
  uint64_t cursor = 0;
  hd_res_entry e;
  std::vector<int> types;
  hd_read_status st;
  while ((st = hd_res_reader_next(r, &cursor, &e)) == HD_READ_OK) {
    types.push_back(e.type);
    if (e.type == HD_ENTRY_REGION) {
      EXPECT_STREQ(e.u.region.name, "/usr/bin/thing");
      EXPECT_EQ(e.u.region.build_id_len, 20u);
      EXPECT_EQ(e.u.region.build_id[19], 19);
      EXPECT_EQ(e.u.region.vaddr, 0x401000u);
    }
  }
  EXPECT_EQ(st, HD_READ_END);
  // The table's first record is its own: where its dedup index is (not the program's memory).
  EXPECT_EQ(types, (std::vector<int>{HD_ENTRY_MAPPING, HD_ENTRY_THREAD, HD_ENTRY_REGION}));
  hd_res_count_alloc(&t, nullptr, 0, 1, 100, 0);
  hd_res_count_alloc(&t, nullptr, 0, 1, 300, 0);
  hd_res_count_free(&t, nullptr, 1, 300, 0, 0);
  hd_table_stats s;
  ASSERT_EQ(hd_res_reader_stats(r, &s), HD_READ_OK);
  EXPECT_EQ(s.blocks_allocated, 2u);
  EXPECT_EQ(s.live_bytes, 100u);
  EXPECT_EQ(s.peak_live_bytes, 400u);
  // A zero-size record would make iteration loop: must be reported instead.
  ((hd_rec_header *)(t.base + th))->size = 0;
  cursor = 0;
  while ((st = hd_res_reader_next(r, &cursor, &e)) == HD_READ_OK)
    EXPECT_NE(e.type, HD_ENTRY_THREAD);
  EXPECT_EQ(st, HD_READ_ERR_CORRUPT);
}

// Peak marks: a new one each time the live bytes rise 1% past the last; a block allocated by the
// mark and freed after it is counted to its trace under the mark's number, and a count of an
// older mark starts over.
TEST_F(ResTable, PeakMarksAndTheBlocksLiveAtThemThatAreFreedSince) {
  const uint64_t f[2] = {0x401000, 0x402000};
  const uint32_t key = hd_res_intern_stack(&t, f, 2, 0);
  ASSERT_NE(key, 0u);
  const uint64_t start = t.start_time_ns;
  auto stats = [&] {
    hd_table_stats s;
    EXPECT_EQ(hd_res_reader_stats(r, &s), HD_READ_OK);
    return s;
  };
  auto freed_since = [&](uint64_t *blocks, uint64_t *bytes) {
    uint64_t frames[4];
    size_t n;
    hd_trace_counters c{};
    EXPECT_EQ(hd_res_reader_stack(r, key, frames, 4, &n, &c, nullptr), HD_READ_OK);
    *blocks = c.peak_freed_blocks;
    *bytes = c.peak_freed_bytes;
  };
  EXPECT_EQ(stats().peak_mark, 0u);
  hd_res_count_alloc(&t, nullptr, key, 1, 1000, start + 1000);
  const uint64_t first = stats().peak_mark;
  EXPECT_EQ(hd_peak_mark_number(first), 1u);
  EXPECT_EQ(hd_peak_mark_value(first), 1000u >> HD_PEAK_TIME_SHIFT);
  EXPECT_EQ(stats().peak_mark_bytes, 1000u);
  // Less than 1% more: no new mark; a block allocated after the mark gets a later time.
  hd_res_count_alloc(&t, nullptr, key, 1, 9, start + 1000);
  EXPECT_EQ(stats().peak_mark, first);
  EXPECT_TRUE(hd_peak_allocated_by(start + 1000, start, first));
  EXPECT_FALSE(hd_peak_allocated_by(hd_res_timestamp_after_mark(&t, start + 1000), start, first));
  EXPECT_EQ(hd_res_timestamp_after_mark(&t, start + 90000), start + 90000);
  // Past 1% more, but without an allocation's time (0: what a free passes): no mark.
  hd_res_count_alloc(&t, nullptr, key, 1, 20, 0);
  EXPECT_EQ(stats().peak_mark, first);
  // The first block, freed: live at the mark; so was the one of time 0, before it. The second
  // was not.
  hd_res_count_free(&t, nullptr, 1, 1000, key, start + 1000);
  hd_res_count_free(&t, nullptr, 1, 9, key, hd_res_timestamp_after_mark(&t, start + 1000));
  hd_res_count_free(&t, nullptr, 1, 20, key, 0);
  uint64_t blocks, bytes;
  freed_since(&blocks, &bytes);
  EXPECT_EQ(hd_peak_mark_number(blocks), 1u);
  EXPECT_EQ(hd_peak_mark_value(blocks), 2u);
  EXPECT_EQ(hd_peak_mark_value(bytes), 1020u);
  // A higher peak: mark 2, whose freed count starts from zero.
  hd_res_count_alloc(&t, nullptr, key, 1, 5000, start + 50000);
  EXPECT_EQ(hd_peak_mark_number(stats().peak_mark), 2u);
  EXPECT_EQ(stats().peak_mark_bytes, 5000u);
  hd_res_count_free(&t, nullptr, 1, 5000, key, start + 50000);
  freed_since(&blocks, &bytes);
  EXPECT_EQ(hd_peak_mark_number(bytes), 2u);
  EXPECT_EQ(hd_peak_mark_value(blocks), 1u);
  EXPECT_EQ(hd_peak_mark_value(bytes), 5000u);
}

TEST_F(ResTable, NoWaitInternFindsKnownTracesAndDropsNewOnesWhileLocked) {
  uint64_t known[2] = {0x401000, 0x402000}, fresh[2] = {0x403000, 0x404000};
  uint32_t k = hd_res_intern_stack(&t, known, 2, 0);
  ASSERT_NE(k, 0u);
  ASSERT_EQ(pthread_mutex_lock(&t.lock), 0);  // as if the interrupted code held it
  EXPECT_EQ(hd_res_intern_stack_nowait(&t, known, 2, 0), k);
  EXPECT_EQ(hd_res_intern_stack_nowait(&t, fresh, 2, 0), 0u);
  ASSERT_EQ(pthread_mutex_unlock(&t.lock), 0);
  hd_table_stats stats;
  ASSERT_EQ(hd_res_reader_stats(r, &stats), HD_READ_OK);
  EXPECT_EQ(stats.dropped_stack_traces, 1u);
  uint32_t fresh_key = hd_res_intern_stack_nowait(&t, fresh, 2, 0);
  EXPECT_NE(fresh_key, 0u);
  EXPECT_EQ(hd_res_intern_stack(&t, fresh, 2, 0), fresh_key);
}

TEST_F(ResTable, ReconcileMakesCountersAgreeWithTheLiveSet) {
  hd_res_count_alloc(&t, nullptr, 0, 1, 100, 0);
  hd_res_count_alloc(&t, nullptr, 0, 1, 50, 0);
  hd_res_count_alloc(&t, nullptr, 0, 1, 10, 0);
  hd_res_count_free(&t, nullptr, 1, 10, 0, 0);
  // A copy whose live set has one more block than the counters say (a count not yet made)...
  hd_res_reconcile_live(&t, 3, 170);
  hd_table_stats stats;
  ASSERT_EQ(hd_res_reader_stats(r, &stats), HD_READ_OK);
  EXPECT_EQ(stats.live_blocks, 3u);
  EXPECT_EQ(stats.live_bytes, 170u);
  EXPECT_EQ(stats.peak_live_bytes, 170u);
  // ...and one with a block fewer (a free whose count was not yet made).
  hd_res_reconcile_live(&t, 1, 100);
  ASSERT_EQ(hd_res_reader_stats(r, &stats), HD_READ_OK);
  EXPECT_EQ(stats.live_blocks, 1u);
  EXPECT_EQ(stats.live_bytes, 100u);
  EXPECT_EQ(stats.blocks_allocated, 3u);
  EXPECT_EQ(stats.peak_live_bytes, 170u);
}

// A thread's own free nodes are reused by that thread without touching the shared list, and
// go back to it when the thread retires.
TEST_F(AllocTable, ThreadNodeCacheReusesNodesAndHandsThemBack) {
  hd_writer_thread w{};
  for (int round = 0; round < 1000; round++) {
    for (uint64_t a = 1; a <= 10; a++) ASSERT_EQ(Insert(&t, &w, Info(a * 16, a)), HD_INSERT_NEW);
    for (uint64_t a = 1; a <= 10; a++) ASSERT_TRUE(Erase(&t, &w, a * 16, nullptr));
  }
  uint32_t high_water = t.hdr->node_high_water;
  EXPECT_LE(high_water, 2 * HD_THREAD_NODE_CACHE);
  EXPECT_EQ(t.free_top & 0xffffffffu, HD_NO_NODE_LINK);  // nothing went through the shared list
  EXPECT_GT(w.node_count, 0u);
  // More frees than the cache holds spill half of it to the shared list.
  for (uint64_t a = 1; a <= 100; a++) ASSERT_EQ(Insert(&t, &w, Info(a * 16, a)), HD_INSERT_NEW);
  for (uint64_t a = 1; a <= 100; a++) ASSERT_TRUE(Erase(&t, &w, a * 16, nullptr));
  EXPECT_LE(w.node_count, HD_THREAD_NODE_CACHE);
  EXPECT_NE(t.free_top & 0xffffffffu, HD_NO_NODE_LINK);
  hd_res_table res{};
  ASSERT_EQ(hd_res_table_create(&res, 1 << 20, "test-res"), 0);
  hd_writer_thread_retire(&t, &res, &w);
  EXPECT_EQ(w.node_count, 0u);
  EXPECT_TRUE(w.retired);
  // Every node is free again: a table's worth of inserts without a writer raises no high water.
  high_water = t.hdr->node_high_water;
  for (uint64_t a = 1; a <= high_water; a++)
    ASSERT_EQ(Insert(&t, nullptr, Info(a * 16, a)), HD_INSERT_NEW);
  EXPECT_EQ(t.hdr->node_high_water, high_water);
  EXPECT_EQ(Snapshot(t.memfd.fd).size(), high_water);
  hd_res_table_destroy(&res);
}

TEST_F(AllocTable, SumCountsEveryLiveRecord) {
  for (uint64_t a = 1; a <= 5000; a++)
    ASSERT_EQ(Insert(&t, nullptr, Info(a * 16, a)), HD_INSERT_NEW);
  hd_alloc_info out;
  ASSERT_TRUE(Erase(&t, nullptr, 16 * 100, &out));
  uint64_t blocks, bytes;
  hd_alloc_table_sum_locked(&t, 0, &blocks, &bytes);
  EXPECT_EQ(blocks, 4999u);
  EXPECT_EQ(bytes, 5000u * 5001 / 2 - 100);
}

// Per-thread counters: the collector's reader and the library's own sum agree, a retired
// thread's record is reused (not appended again) and keeps its counts, and the peak of a single
// writer is exact although it holds back its share of the live bytes.
TEST_F(ResTable, ThreadCountersAddUpAndAreReusedAfterExit) {
  hd_writer_thread a{}, b{};
  ASSERT_TRUE(hd_res_attach_counters(&t, &a));
  ASSERT_NE(a.counters_key, 0u);
  hd_res_count_alloc(&t, &a, 0, 1, 1000, 0);
  hd_res_count_alloc(&t, &a, 0, 1, 24, 0);
  hd_res_count_free(&t, &a, 1, 1000, 0, 0);
  hd_res_count_alloc(&t, nullptr, 0, 1, 5, 0);  // a thread without a record counts into the base
  hd_table_stats s;
  ASSERT_EQ(hd_res_reader_stats(r, &s), HD_READ_OK);
  EXPECT_EQ(s.blocks_allocated, 3u);
  EXPECT_EQ(s.bytes_allocated, 1029u);
  EXPECT_EQ(s.blocks_freed, 1u);
  EXPECT_EQ(s.live_bytes, 29u);
  EXPECT_EQ(s.peak_live_bytes, 1029u);
  hd_stats_block own;
  hd_res_read_stats(&t, &own);
  EXPECT_EQ(own.bytes_allocated, s.bytes_allocated);
  EXPECT_EQ(own.bytes_freed, s.bytes_freed);
  uint32_t key = a.counters_key;
  hd_alloc_table at{};
  ASSERT_EQ(hd_alloc_table_create(&at, 0, "test-alloc"), 0);
  hd_writer_thread_retire(&at, &t, &a);
  uint64_t used = t.hdr->used;
  ASSERT_TRUE(hd_res_attach_counters(&t, &b));
  EXPECT_EQ(b.counters_key, key);
  EXPECT_EQ(t.hdr->used, used);
  hd_res_count_free(&t, &b, 1, 24, 0, 0);
  ASSERT_EQ(hd_res_reader_stats(r, &s), HD_READ_OK);
  EXPECT_EQ(s.blocks_freed, 2u);
  EXPECT_EQ(s.live_bytes, 5u);
  // A corrupt link is reported, not followed.
  ((hd_rec_counters *)(t.base + key))->next = key;
  EXPECT_EQ(hd_res_reader_stats(r, &s), HD_READ_ERR_CORRUPT);
  hd_alloc_table_destroy(&at);
}

// Threads keep their counts of the traces they allocated with last in their own counters records
// (no shared line written while they repeat a trace) and move them into the traces' records when
// an entry changes hands. A reader running meanwhile reads each trace's counts whole: never less
// than the counts finished before the read, never more than those started by its end; and a
// fork's copy (under the gate) holds every finished count once.
TEST_F(ResTable, TraceCountsHeldByThreadsAreReadWholeWhileTheyChange) {
  constexpr int kTraces = 40, kWriters = 3, kRounds = 150000;
  uint32_t keys[kTraces];
  for (int i = 0; i < kTraces; i++) {
    uint64_t frame = 0x400000 + 16 * (uint64_t)i;
    keys[i] = hd_res_intern_stack(&t, &frame, 1, 0);
    ASSERT_NE(keys[i], 0u);
  }
  std::atomic<uint64_t> started[kTraces], finished[kTraces];
  for (int i = 0; i < kTraces; i++) started[i] = finished[i] = 0;
  std::atomic<int> running{kWriters};
  hd_writer_thread writers[kWriters]{};
  struct JoinedAtExit : std::vector<std::thread> {
    ~JoinedAtExit() {
      for (auto &th : *this)
        if (th.joinable()) th.join();
    }
  } threads;
  for (int w = 0; w < kWriters; w++) {
    threads.emplace_back([&, w] {
      ASSERT_TRUE(hd_res_attach_counters(&t, &writers[w]));
      uint64_t x = 88172645463325252ull + (uint64_t)w;
      for (int round = 0; round < kRounds; round++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        // Runs of one trace (as loops allocate), across more traces than a record has entries.
        const int i = (int)((x >> 8) % 8 == 0 ? (x >> 16) % kTraces : (round / 64 + w) % kTraces);
        started[i].fetch_add(3);
        hd_res_count_alloc(&t, &writers[w], keys[i], 2, 16, 0);
        hd_res_count_temporary(&t, &writers[w], keys[i], 1);
        finished[i].fetch_add(3);
      }
      running.fetch_sub(1);
    });
  }
  uint64_t frames[4];
  size_t n;
  int reads = 0, copies = 0, total_reads = 0, unsettled = 0;
  do {  // at least once, if the writers were quick
    // Every other round through an index of the entries, made before the round (as a snapshot
    // makes it after reading the live blocks): it counts from then on.
    uint64_t before_index[kTraces];
    for (int i = 0; i < kTraces; i++) before_index[i] = finished[i].load();
    hd_pending_index *index = reads % 2 ? hd_res_reader_pending_index(r) : nullptr;
    for (int i = 0; i < kTraces; i++) {
      const uint64_t before = index ? before_index[i] : finished[i].load();
      hd_trace_counters c{};
      ASSERT_EQ(hd_res_reader_stack_indexed(r, index, keys[i], frames, 4, &n, &c, nullptr),
                HD_READ_OK);
      const uint64_t after = started[i].load();
      total_reads++;
      if (c.unsettled) {  // a writer stopped mid-change past the reads' patience: said, not hidden
        unsettled++;
        continue;
      }
      // Each count call adds 2 blocks, 16 bytes and 1 temporary block: 3 per call started.
      ASSERT_GE(c.allocated_blocks + c.temporary_blocks, before) << "trace " << i;
      ASSERT_LE(c.allocated_blocks + c.temporary_blocks, after) << "trace " << i;
      // Each call adds 16 bytes: the bytes too were read at some moment of the read.
      ASSERT_GE(c.allocated_bytes * 3, before * 16) << "trace " << i;
      ASSERT_LE(c.allocated_bytes * 3, after * 16) << "trace " << i;
    }
    hd_pending_index_free(index);
    reads++;
    if (copies < 20) {  // what a fork's prepare handler does
      uint64_t before[kTraces], after[kTraces];
      pthread_mutex_lock(&t.lock);
      for (int i = 0; i < kTraces; i++) before[i] = finished[i].load();
      EXPECT_TRUE(hd_res_fork_gate_close(&t, nullptr));
      hd_res_table copy{};
      const int cloned = hd_res_table_clone_locked(&t, &copy, "test-res-copy");
      hd_res_fork_gate_open(&t);  // before any ASSERT: the writers wait at a closed gate
      for (int i = 0; i < kTraces; i++) after[i] = started[i].load();
      pthread_mutex_unlock(&t.lock);
      ASSERT_EQ(cloned, 0);
      // No entry of the copy is left mid-change: no thread of the copy would end it.
      for (uint32_t off = copy.hdr->counters_head; off != 0;) {
        const auto *c = (const hd_rec_counters *)(copy.base + off);
        for (const hd_pending_trace &e : c->pending) EXPECT_EQ(e.seq % 2, 0u);
        off = c->next;
      }
      hd_res_reader *cr = nullptr;
      ASSERT_EQ(hd_res_reader_open(copy.memfd.fd, &cr), HD_READ_OK);
      for (int i = 0; i < kTraces; i++) {
        hd_trace_counters c{};
        ASSERT_EQ(hd_res_reader_stack(cr, keys[i], frames, 4, &n, &c, nullptr), HD_READ_OK);
        EXPECT_GE(c.allocated_blocks + c.temporary_blocks, before[i]) << "trace " << i;
        EXPECT_LE(c.allocated_blocks + c.temporary_blocks, after[i]) << "trace " << i;
      }
      hd_res_reader_close(cr);
      hd_res_table_destroy(&copy);
      copies++;
    }
  } while (running.load() != 0);
  for (auto &th : threads) th.join();
  EXPECT_GE(reads, 1);
  EXPECT_LE(unsettled * 10, total_reads);  // a second's patience: a stall that long is rare
  // Every count taken: the exact sums below.
  uint64_t bytes_of_all = 0;
  hd_alloc_table at{};
  ASSERT_EQ(hd_alloc_table_create(&at, 0, "test-alloc"), 0);
  uint32_t records[kWriters];
  for (int w = 0; w < kWriters; w++) records[w] = writers[w].counters_key;
  for (int pass = 0; pass < 2; pass++) {  // exact when still, before and after the threads exit
    uint64_t all = 0;
    for (int i = 0; i < kTraces; i++) {
      hd_trace_counters c{};
      ASSERT_EQ(hd_res_reader_stack(r, keys[i], frames, 4, &n, &c, nullptr), HD_READ_OK);
      EXPECT_EQ(c.allocated_blocks + c.temporary_blocks, finished[i].load()) << "trace " << i;
      EXPECT_EQ(c.temporary_blocks * 2, c.allocated_blocks) << "trace " << i;
      EXPECT_EQ(c.allocated_bytes, c.allocated_blocks * 8) << "trace " << i;
      hd_pending_index *index = hd_res_reader_pending_index(r);
      hd_trace_counters through_index{};
      ASSERT_EQ(
          hd_res_reader_stack_indexed(r, index, keys[i], frames, 4, &n, &through_index, nullptr),
          HD_READ_OK);
      hd_pending_index_free(index);
      EXPECT_EQ(through_index.allocated_blocks, c.allocated_blocks) << "trace " << i;
      EXPECT_EQ(through_index.temporary_blocks, c.temporary_blocks) << "trace " << i;
      all += c.temporary_blocks;
      bytes_of_all += c.allocated_bytes;
    }
    EXPECT_EQ(all, (uint64_t)kWriters * kRounds);
    EXPECT_EQ(bytes_of_all, (pass + 1) * 16ull * kWriters * kRounds);
    for (auto &w : writers) hd_writer_thread_retire(&at, &t, &w);
  }
  for (uint32_t key : records) {  // handed back empty, and even
    const auto *c = (const hd_rec_counters *)(t.base + key);
    for (const hd_pending_trace &e : c->pending) {
      EXPECT_EQ(e.stack_key, 0u);
      EXPECT_EQ(e.seq % 2, 0u);
    }
  }
  hd_alloc_table_destroy(&at);
}

// A thread stopped in the middle of changing an entry's key (its seq odd): a read waits for it
// a while and then says its counts are unsettled; reads through one index wait a second in
// all. A fork cannot copy the forking thread's own record in that state; a change that backed out
// at the gate, caught by the copy, is left even there.
TEST_F(ResTable, AnEntryStoppedMidChangeIsWaitedForThenReported) {
  hd_writer_thread w{};
  ASSERT_TRUE(hd_res_attach_counters(&t, &w));
  uint64_t frame = 0x401234;
  const uint32_t key = hd_res_intern_stack(&t, &frame, 1, 0);
  ASSERT_NE(key, 0u);
  hd_res_count_alloc(&t, &w, key, 1, 40, 1);  // the entry takes the trace
  auto *c = (hd_rec_counters *)(t.base + w.counters_key);
  hd_pending_trace *e = &c->pending[hd_pending_slot(key)];
  ASSERT_EQ(e->stack_key, key);
  uint64_t frames[4];
  size_t n;
  hd_trace_counters settled{};
  ASSERT_EQ(hd_res_reader_stack(r, key, frames, 4, &n, &settled, nullptr), HD_READ_OK);
  EXPECT_FALSE(settled.unsettled);
  EXPECT_EQ(settled.allocated_bytes, 40u);

  e->seq |= 1;                                   // stopped after making it odd
  EXPECT_FALSE(hd_res_fork_gate_close(&t, &w));  // its own record: not waited for, refused
  hd_res_fork_gate_open(&t);
  hd_trace_counters c1{};
  auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(hd_res_reader_stack(r, key, frames, 4, &n, &c1, nullptr), HD_READ_OK);
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(c1.unsettled);
  EXPECT_GE(waited, 0.9);
  EXPECT_LT(waited, 10.0);
  hd_pending_index *index = hd_res_reader_pending_index(r);
  ASSERT_NE(index, nullptr);
  for (int i = 0; i < 3; i++) {
    ASSERT_EQ(hd_res_reader_stack_indexed(r, index, key, frames, 4, &n, &c1, nullptr), HD_READ_OK);
    EXPECT_TRUE(c1.unsettled);
  }
  start = std::chrono::steady_clock::now();  // the index's second is spent: no more waiting
  ASSERT_EQ(hd_res_reader_stack_indexed(r, index, key, frames, 4, &n, &c1, nullptr), HD_READ_OK);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 0.1);
  hd_pending_index_free(index);

  // A change that backed out at a closed gate leaves seq odd for a moment; the copy is even.
  e->seq &= ~1u;
  pthread_mutex_lock(&t.lock);
  ASSERT_TRUE(hd_res_fork_gate_close(&t, nullptr));
  e->seq |= 1;
  hd_res_table copy{};
  const int cloned = hd_res_table_clone_locked(&t, &copy, "test-res-copy");
  e->seq += 1;  // backed out: even again, nothing changed
  hd_res_fork_gate_open(&t);
  pthread_mutex_unlock(&t.lock);
  ASSERT_EQ(cloned, 0);
  const auto *cc = (const hd_rec_counters *)(copy.base + w.counters_key);
  EXPECT_EQ(cc->pending[hd_pending_slot(key)].seq % 2, 0u);
  EXPECT_EQ(cc->pending[hd_pending_slot(key)].alloc_bytes, 40u);
  hd_res_reader *cr = nullptr;
  ASSERT_EQ(hd_res_reader_open(copy.memfd.fd, &cr), HD_READ_OK);
  hd_trace_counters cc1{};
  ASSERT_EQ(hd_res_reader_stack(cr, key, frames, 4, &n, &cc1, nullptr), HD_READ_OK);
  EXPECT_FALSE(cc1.unsettled);
  EXPECT_EQ(cc1.allocated_bytes, 40u);
  hd_res_reader_close(cr);
  hd_res_table_destroy(&copy);
}

// The dedup index starts small and doubles; traces interned before and after each doubling are
// still found under their own keys. The index compares fingerprints, not frames: traces that
// differ in one frame (neighbouring return addresses, as real traces do) keep distinct keys,
// and each key's record holds its own frames.
TEST(ResTableIndex, GrowsAndKeepsFindingEveryTrace) {
  hd_res_table t{};
  ASSERT_EQ(hd_res_table_create(&t, 64 << 20, "test-res-index"), 0);
  hd_res_reader *r = nullptr;
  ASSERT_EQ(hd_res_reader_open(t.memfd.fd, &r), HD_READ_OK);
  const uint64_t n = 150000;  // past three doublings of the 32Ki-slot first index
  auto trace = [](uint64_t i, uint64_t f[3]) {
    f[0] = 0x7f0000401000 + i;
    f[1] = 0x7f0000500000 + (i / 64) * 5;
    f[2] = 0x401234;
  };
  std::vector<uint32_t> keys(n);
  for (uint64_t i = 0; i < n; i++) {
    uint64_t f[3];
    trace(i, f);
    keys[i] = hd_res_intern_stack(&t, f, 3, 0);
    ASSERT_NE(keys[i], 0u);
  }
  EXPECT_EQ(std::set<uint32_t>(keys.begin(), keys.end()).size(), n);
  for (uint64_t i = 0; i < n; i++) {
    uint64_t f[3];
    trace(i, f);
    ASSERT_EQ(hd_res_intern_stack(&t, f, 3, 0), keys[i]) << i;
    uint64_t got[4];
    size_t count;
    ASSERT_EQ(hd_res_reader_stack(r, keys[i], got, 4, &count, nullptr, nullptr), HD_READ_OK);
    ASSERT_EQ(count, 3u);
    ASSERT_TRUE(got[0] == f[0] && got[1] == f[1] && got[2] == f[2]) << i;
  }
  EXPECT_EQ(t.hdr->stats.dropped_stack_traces, 0u);
  hd_res_reader_close(r);
  hd_res_table_destroy(&t);
}

TEST(ResTableCap, FullTableDropsAndCounts) {
  hd_res_table t{};
  ASSERT_EQ(hd_res_table_create(&t, 0, "test-res-small"), 0);  // clamped to 64 KiB
  uint32_t dropped_at = 0;
  for (uint64_t i = 0; i < 100000 && !dropped_at; i++) {
    uint64_t f[8] = {i, i + 1, i + 2, i + 3, i + 4, i + 5, i + 6, i + 7};
    if (hd_res_intern_stack(&t, f, 8, 0) == 0) dropped_at = (uint32_t)i;
  }
  EXPECT_GT(dropped_at, 0u);
  EXPECT_EQ(t.hdr->stats.dropped_stack_traces, 1u);
  // What the last trace left may still hold a record or two as small as a thread's.
  unsigned added = 0;
  while (added < 8 && hd_res_add_thread(&t, 1, "x", 0) != 0u) added++;
  EXPECT_LT(added, 8u);
  EXPECT_EQ(t.hdr->stats.dropped_resources, 1u);
  hd_res_table_destroy(&t);
}

}  // namespace

// Sampled recording's weights (shm_layout.h), which the library and the collector both compute:
// the probability is 1 - e^(-s/N) to a double's precision, and the integer weights of blocks
// average its inverse, so that a site's estimate is unbiased.
TEST(SampleWeight, IntegerWeightsAverageTheInverseOfTheProbability) {
  const uint64_t n = 524288;
  for (uint64_t size : {1ull, 64ull, 4096ull, 300000ull, 1ull << 20, 1ull << 24, 1ull << 40}) {
    const double p = -std::expm1(-static_cast<double>(size) / n);
    EXPECT_NEAR(hd_sample_probability(size, n), p, p * 1e-13) << size;
    double sum = 0;
    const int blocks = 200000;
    for (int i = 0; i < blocks; i++) {
      const uint64_t k =
          hd_sample_weight(0x7f0000000000ull + 16ull * (i % 64), 1000000ull * i, size, n);
      EXPECT_TRUE(k == static_cast<uint64_t>(1 / p) || k == static_cast<uint64_t>(1 / p) + 1);
      sum += static_cast<double>(k);
    }
    EXPECT_NEAR(sum / blocks, 1 / p, 0.005 / p + 0.005) << size;
  }
  EXPECT_EQ(hd_sample_weight(0x1000, 7, 64, 0), 1u);  // every block recorded
  EXPECT_EQ(hd_sample_weight(0x1000, 7, 0, n), 1u);
}
