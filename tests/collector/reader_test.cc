// The table reader on allocations tables written by hand as shm_layout.h lays them out (not by
// the library's writer), so that each test can put exactly the nodes it needs: freed nodes,
// duplicate addresses, hostile header fields, slots left locked.
#include <fcntl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "heapdump/contract/shm_layout.h"
#include "table_reader.h"

namespace {

class HandTable {
 public:
  static constexpr uint32_t kCapacity = 8192;

  // A table of kCapacity nodes in a memfd of at least min_size bytes (the rest unused).
  explicit HandTable(size_t min_size = 0) {
    const uint64_t seq_offset = sizeof(hd_alloc_header);
    const uint64_t nodes_offset = seq_offset + 4ull * HD_SEQ_SLOTS;
    size_ = std::max<size_t>(
        (nodes_offset + kCapacity * sizeof(hd_alloc_node) + 4095) & ~size_t{4095}, min_size);
    fd_ = memfd_create("hand-table", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(size_)), 0);
    EXPECT_EQ(fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
    void *base = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(base, MAP_FAILED);
    base_ = static_cast<uint8_t *>(base);
    header_ = reinterpret_cast<hd_alloc_header *>(base_);
    header_->magic = HD_ALLOC_MAGIC;
    header_->version = HD_LAYOUT_VERSION;
    header_->header_size = sizeof(hd_alloc_header);
    header_->total_size = size_;
    header_->node_size = sizeof(hd_alloc_node);
    header_->seq_slots = HD_SEQ_SLOTS;
    header_->nodes_per_slot = HD_NODES_PER_SLOT;
    header_->node_capacity = kCapacity;
    header_->seq_offset = seq_offset;
    header_->nodes_offset = nodes_offset;
    header_->pid = static_cast<uint32_t>(getpid());
    nodes_ = reinterpret_cast<hd_alloc_node *>(base_ + nodes_offset);
  }
  ~HandTable() {
    munmap(base_, size_);
    close(fd_);
  }

  // Records address in the next node, allocated at `timestamp`; returns the node.
  uint32_t Add(uint64_t address, uint64_t size, uint64_t timestamp = 1) {
    EXPECT_LT(used_, kCapacity);
    hd_alloc_node &node = nodes_[used_];
    node = hd_alloc_node{};
    node.address_word = hd_node_address_word(address, size);
    node.size_low = static_cast<uint32_t>(size);
    node.time_word = hd_node_time_word(timestamp, 0, 0);
    header_->node_high_water = ++used_;
    return used_ - 1;
  }

  // Frees node index, as an erase does.
  void Remove(uint32_t index) { nodes_[index].address_word = 0; }

  void SetHighWater(uint32_t value) { header_->node_high_water = value; }

  // Locks (or unlocks) a sequence slot as a writer does: odd while it updates the slot's nodes.
  void SetSlotLocked(uint64_t slot, bool locked) {
    uint32_t *seq = reinterpret_cast<uint32_t *>(base_ + header_->seq_offset);
    if (((seq[slot] & 1) != 0) != locked) __atomic_add_fetch(&seq[slot], 1, __ATOMIC_RELEASE);
  }

  hd_read_status Snapshot(std::vector<hd_live_block> *out, bool sorted,
                          hd_read_limits *limits = nullptr) const {
    hd_alloc_reader *reader = nullptr;
    hd_read_status status = hd_alloc_reader_open(fd_, &reader);
    if (status != HD_READ_OK) return status;
    hd_live_block *blocks = nullptr;
    size_t count = 0;
    status = sorted ? hd_alloc_reader_snapshot(reader, &blocks, &count)
                    : hd_alloc_reader_snapshot_unordered(reader, limits, &blocks, &count);
    if (status == HD_READ_OK) {
      out->assign(blocks, blocks + count);
    } else {
      EXPECT_EQ(blocks, nullptr);
    }
    free(blocks);
    hd_alloc_reader_close(reader);
    return status;
  }

 private:
  int fd_ = -1;
  size_t size_ = 0;
  uint8_t *base_ = nullptr;
  hd_alloc_header *header_ = nullptr;
  hd_alloc_node *nodes_ = nullptr;
  uint32_t used_ = 0;
};

std::vector<uint64_t> RandomAddresses(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::set<uint64_t> distinct;
  while (distinct.size() < n) distinct.insert((rng() & 0x7fffffffff0) + 0x100000);
  return {distinct.begin(), distinct.end()};
}

std::multiset<uint64_t> AddressesOf(const std::vector<hd_live_block> &blocks) {
  std::multiset<uint64_t> out;
  for (const auto &b : blocks) out.insert(b.address);
  return out;
}

// Every live node once, freed ones not at all, in node order or sorted by address.
TEST(TableReader, EveryLiveNodeOnceInTableOrderOrSorted) {
  HandTable table;
  std::multiset<uint64_t> expected;
  std::vector<uint64_t> addresses = RandomAddresses(3000, 1);
  for (size_t i = 0; i < addresses.size(); i++) {
    const uint32_t node = table.Add(addresses[i], 24);
    if (i % 7 == 3) {
      table.Remove(node);
    } else {
      expected.insert(addresses[i]);
    }
  }
  std::vector<hd_live_block> unordered, sorted;
  ASSERT_EQ(table.Snapshot(&unordered, false), HD_READ_OK);
  ASSERT_EQ(table.Snapshot(&sorted, true), HD_READ_OK);
  EXPECT_EQ(AddressesOf(unordered), expected);
  EXPECT_EQ(AddressesOf(sorted), expected);
  EXPECT_TRUE(std::is_sorted(
      sorted.begin(), sorted.end(),
      [](const hd_live_block &a, const hd_live_block &b) { return a.address < b.address; }));
}

// The high-water mark bounds the nodes read: one past the capacity reads the capacity, one
// below a live node leaves that node out (it was handed out after the copy began, as far as
// the reader can tell).
TEST(TableReader, HighWaterMarkBoundsTheNodesRead) {
  for (uint32_t high_water : {3000u, 3001u, HandTable::kCapacity, UINT32_MAX}) {
    HandTable table;
    for (uint64_t address : RandomAddresses(3000, 4)) table.Add(address, 24);
    table.SetHighWater(high_water);
    std::vector<hd_live_block> blocks;
    ASSERT_EQ(table.Snapshot(&blocks, false), HD_READ_OK) << high_water;
    EXPECT_EQ(blocks.size(), 3000u) << high_water;
  }
  for (uint32_t high_water : {0u, 1u, 2999u}) {
    HandTable table;
    for (uint64_t address : RandomAddresses(3000, 4)) table.Add(address, 24);
    table.SetHighWater(high_water);
    std::vector<hd_live_block> blocks;
    ASSERT_EQ(table.Snapshot(&blocks, false), HD_READ_OK) << high_water;
    EXPECT_EQ(blocks.size(), high_water) << high_water;
  }
}

// An address in two nodes (a block freed and allocated again in a later node while the copy
// ran, or a hostile table) is copied once, the newer record; many doubles, or a table recording
// one address in every node, likewise.
TEST(TableReader, AnAddressInSeveralNodesIsCopiedOnceTheNewerRecord) {
  HandTable table;
  const std::vector<uint64_t> addresses = RandomAddresses(3000, 2);
  for (uint64_t a : addresses) table.Add(a, 24);
  table.Add(0x5000, 8, 1);
  table.Add(0x5000, 16, 3);
  table.Add(0x5000, 12, 2);
  for (size_t i = 0; i < addresses.size(); i += 3) table.Add(addresses[i], 40, 5);
  std::vector<hd_live_block> blocks;
  ASSERT_EQ(table.Snapshot(&blocks, true), HD_READ_OK);
  std::multiset<uint64_t> expected(addresses.begin(), addresses.end());
  expected.insert(0x5000);
  EXPECT_EQ(AddressesOf(blocks), expected);
  std::set<uint64_t> added_again;
  for (size_t i = 0; i < addresses.size(); i += 3) added_again.insert(addresses[i]);
  for (const auto &b : blocks) {
    const uint64_t want = b.address == 0x5000 ? 16 : added_again.count(b.address) ? 40 : 24;
    EXPECT_EQ(b.size, want) << std::hex << b.address;
  }
  HandTable everywhere;
  for (int i = 0; i < 5000; i++) everywhere.Add(0x7000, 8 + i, 1 + i);
  ASSERT_EQ(everywhere.Snapshot(&blocks, false), HD_READ_OK);
  ASSERT_EQ(blocks.size(), 1u);
  EXPECT_EQ(blocks[0].size, 8u + 4999);
}

// A slot left locked by a writer that will never come back (its process was killed inside the
// library) holds a live reader for its whole patience and then fails it; a reader told the
// table is final reads it as left, at once.
TEST(TableReader, AFinalTableIsReadAsLeftWithoutWaitingForItsLocks) {
  HandTable table;
  const std::vector<uint64_t> addresses = RandomAddresses(200, 7);
  uint32_t first = UINT32_MAX;
  for (uint64_t a : addresses) {
    const uint32_t node = table.Add(a, 32);
    if (first == UINT32_MAX) first = node;
  }
  table.SetSlotLocked(hd_node_slot(first), true);
  std::vector<hd_live_block> blocks;
  EXPECT_EQ(table.Snapshot(&blocks, false), HD_READ_ERR_BUSY);
  hd_read_limits final_table = {};
  final_table.final = true;
  ASSERT_EQ(table.Snapshot(&blocks, false, &final_table), HD_READ_OK);
  EXPECT_EQ(AddressesOf(blocks), std::multiset<uint64_t>(addresses.begin(), addresses.end()));
}

// A writer that holds each slot just under the per-slot patience, then the next, would keep a
// reader for patience x slots (an hour); the deadline ends it, and so does a stop request.
TEST(TableReader, TheDeadlineAndAStopEndAReadThatAWriterKeepsWaiting) {
  HandTable table;
  for (uint64_t a : RandomAddresses(500, 9)) table.Add(a, 32);
  std::atomic<bool> done{false};
  table.SetSlotLocked(0, true);  // before the reader starts, which is far quicker than a thread
  std::thread hostile([&] {
    for (uint64_t slot = 0; !done; slot = (slot + 1) % HD_SEQ_SLOTS) {
      for (int i = 0; i < 80 && !done; i++) usleep(10000);   // 0.8 s
      table.SetSlotLocked((slot + 1) % HD_SEQ_SLOTS, true);  // the next first: no gap to slip in
      table.SetSlotLocked(slot, false);
    }
  });
  std::vector<hd_live_block> blocks;
  hd_read_limits limits = {};
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  limits.deadline_ns = static_cast<uint64_t>(now.tv_sec) * 1000000000u + now.tv_nsec + 3000000000u;
  EXPECT_EQ(table.Snapshot(&blocks, false, &limits), HD_READ_ERR_TIMED_OUT);
  hd_read_limits stopping = {};
  std::atomic<bool> stop{false};
  stopping.stop = [](void *flag) { return static_cast<std::atomic<bool> *>(flag)->load(); };
  stopping.stop_ctx = &stop;
  std::thread stopper([&] {
    sleep(2);
    stop = true;
  });
  EXPECT_EQ(table.Snapshot(&blocks, false, &stopping), HD_READ_ERR_STOPPED);
  stopper.join();
  done = true;
  hostile.join();
}

// A memfd larger than any table the library makes is refused before it is mapped, however
// consistent its header: 1,024 processes could otherwise make a collector map address space
// without bound.
TEST(TableReader, AMemfdLargerThanAnyTableIsRefused) {
  HandTable largest(HD_MAX_TABLE_BYTES);
  std::vector<hd_live_block> blocks;
  EXPECT_EQ(largest.Snapshot(&blocks, false), HD_READ_OK);
  HandTable larger(HD_MAX_TABLE_BYTES + 4096);
  EXPECT_EQ(larger.Snapshot(&blocks, false), HD_READ_ERR_BAD_SIZE);
}

}  // namespace
