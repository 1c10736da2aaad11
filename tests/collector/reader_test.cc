// The table reader on allocations tables written by hand as shm_layout.h lays them out (not by
// the library's writer), so that each test can put exactly the chains it needs: long chains,
// duplicate addresses, nodes in a bucket their address does not select, hostile header fields.
#include <fcntl.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <cstdlib>
#include <random>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "heapdump/contract/shm_layout.h"
#include "table_reader.h"

namespace {

class HandTable {
 public:
  static constexpr uint32_t kLog2 = HD_MIN_BUCKET_LOG2;
  static constexpr uint32_t kCapacity = 8192;

  // A table of kCapacity nodes in a memfd of at least min_size bytes (the rest unused).
  explicit HandTable(size_t min_size = 0) {
    const uint64_t seq_offset = sizeof(hd_alloc_header);
    const uint64_t buckets_offset = seq_offset + 4ull * HD_SEQ_SLOTS;
    const uint64_t nodes_offset = buckets_offset + (4ull << kLog2);
    size_ = std::max<size_t>((nodes_offset + kCapacity * sizeof(hd_alloc_node) + 4095) & ~size_t{4095},
                             min_size);
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
    header_->max_bucket_log2 = kLog2;
    header_->bucket_log2 = kLog2;
    header_->node_capacity = kCapacity;
    header_->seq_offset = seq_offset;
    header_->buckets_offset = buckets_offset;
    header_->nodes_offset = nodes_offset;
    header_->pid = static_cast<uint32_t>(getpid());
    buckets_ = reinterpret_cast<uint32_t *>(base_ + buckets_offset);
    nodes_ = reinterpret_cast<hd_alloc_node *>(base_ + nodes_offset);
  }
  ~HandTable() {
    munmap(base_, size_);
    close(fd_);
  }

  static uint64_t BucketOf(uint64_t address) {
    return hd_alloc_hash(address) & ((uint64_t{1} << kLog2) - 1);
  }

  // Links a node for address at the head of a bucket: its own unless another is given.
  void Add(uint64_t address, uint64_t size, int64_t bucket = -1) {
    ASSERT_LT(used_, kCapacity);
    hd_alloc_node &node = nodes_[used_];
    node = hd_alloc_node{};
    node.address_word = hd_node_address_word(address, size);
    node.size_low = static_cast<uint32_t>(size);
    node.time_word = hd_node_time_word(1, 0, 0);
    const uint64_t b = bucket < 0 ? BucketOf(address) : static_cast<uint64_t>(bucket);
    node.next = buckets_[b];
    buckets_[b] = ++used_;
    header_->node_high_water = used_;
  }

  void SetHighWater(uint32_t value) { header_->node_high_water = value; }

  // Makes the last node of a bucket's chain link back to the chain's first.
  void LinkTailToHead(uint64_t bucket) {
    uint32_t link = buckets_[bucket];
    ASSERT_NE(link, HD_LINK_NONE);
    while (nodes_[link - 1].next != HD_LINK_NONE) link = nodes_[link - 1].next;
    nodes_[link - 1].next = buckets_[bucket];
  }

  // Locks (or unlocks) a sequence slot as a writer does: odd while it updates the slot's chains.
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
  uint32_t *buckets_ = nullptr;
  hd_alloc_node *nodes_ = nullptr;
  uint32_t used_ = 0;
};

// n distinct 16-aligned addresses whose bucket is `bucket`.
std::vector<uint64_t> AddressesInBucket(uint64_t bucket, size_t n) {
  std::vector<uint64_t> out;
  for (uint64_t address = 0x10000; out.size() < n; address += 16) {
    if (HandTable::BucketOf(address) == bucket) out.push_back(address);
  }
  return out;
}

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

TEST(TableReader, EveryBlockOnceInTableOrderOrSortedWithLongChains) {
  HandTable table;
  std::multiset<uint64_t> expected;
  for (uint64_t address : RandomAddresses(3000, 1)) {
    table.Add(address, 24);
    expected.insert(address);
  }
  // Chains longer than the reader checks pair by pair, and exactly that long.
  for (auto [bucket, length] : {std::pair<uint64_t, size_t>{7, 40}, {9, 16}, {11, 17}}) {
    for (uint64_t address : AddressesInBucket(bucket, length)) {
      if (expected.count(address) == 0) {
        table.Add(address, 8);
        expected.insert(address);
      }
    }
  }
  std::vector<hd_live_block> unordered, sorted;
  ASSERT_EQ(table.Snapshot(&unordered, false), HD_READ_OK);
  ASSERT_EQ(table.Snapshot(&sorted, true), HD_READ_OK);
  EXPECT_EQ(AddressesOf(unordered), expected);
  EXPECT_EQ(AddressesOf(sorted), expected);
  EXPECT_TRUE(std::is_sorted(sorted.begin(), sorted.end(),
                             [](const hd_live_block &a, const hd_live_block &b) {
                               return a.address < b.address;
                             }));
}

TEST(TableReader, DuplicateAddressInAShortChainIsCorrupt) {
  HandTable table;
  for (uint64_t address : RandomAddresses(500, 2)) table.Add(address, 24);
  const std::vector<uint64_t> chain = AddressesInBucket(3, 3);
  table.Add(chain[0], 8);
  table.Add(chain[1], 8);
  table.Add(chain[0], 16);
  std::vector<hd_live_block> blocks;
  EXPECT_EQ(table.Snapshot(&blocks, false), HD_READ_ERR_CORRUPT);
  EXPECT_EQ(table.Snapshot(&blocks, true), HD_READ_ERR_CORRUPT);
}

TEST(TableReader, DuplicateAddressInALongChainIsCorrupt) {
  HandTable table;
  const std::vector<uint64_t> chain = AddressesInBucket(5, 40);
  table.Add(chain[39], 8);  // at the end of the chain, as nodes are linked at its head
  for (uint64_t address : chain) table.Add(address, 8);
  std::vector<hd_live_block> blocks;
  EXPECT_EQ(table.Snapshot(&blocks, false), HD_READ_ERR_CORRUPT);
}

// A node linked into a bucket its address does not select: refused even when its address is not
// otherwise in the table, and so also when it duplicates a block of its own bucket (which a
// reader that looked for duplicates only within chains would otherwise miss).
TEST(TableReader, NodeInAnotherBucketIsCorrupt) {
  const uint64_t address = AddressesInBucket(21, 1)[0];
  for (bool also_in_its_own_bucket : {false, true}) {
    HandTable table;
    for (uint64_t a : RandomAddresses(200, 3)) table.Add(a, 24);
    if (also_in_its_own_bucket) table.Add(address, 8);
    table.Add(address, 8, 22);
    std::vector<hd_live_block> blocks;
    EXPECT_EQ(table.Snapshot(&blocks, false), HD_READ_ERR_CORRUPT) << also_in_its_own_bucket;
  }
}

// A high-water mark at or above every link (even past the capacity) reads the same blocks; one
// below a link means the table links a node it never handed out.
TEST(TableReader, HighWaterMarkBoundsTheLinks) {
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
    EXPECT_EQ(table.Snapshot(&blocks, false), HD_READ_ERR_CORRUPT) << high_water;
  }
}

// A chain that returns to one of its nodes (itself, or the first of a long chain) is corrupt, and
// is found without walking the capacity's worth of steps the header would allow.
TEST(TableReader, CyclesAreCorrupt) {
  for (size_t length : {size_t{1}, size_t{2}, size_t{40}, size_t{1000}}) {
    HandTable table;
    for (uint64_t address : RandomAddresses(200, 6)) table.Add(address, 24);
    for (uint64_t address : AddressesInBucket(9, length)) table.Add(address, 8);
    table.LinkTailToHead(9);
    std::vector<hd_live_block> blocks;
    EXPECT_EQ(table.Snapshot(&blocks, false), HD_READ_ERR_CORRUPT) << length;
  }
}

// A slot left locked by a writer that will never come back (its process was killed inside the
// library) holds a live reader for its whole patience and then fails it; a reader told the
// table is final reads it as left, at once.
TEST(TableReader, AFinalTableIsReadAsLeftWithoutWaitingForItsLocks) {
  HandTable table;
  const std::vector<uint64_t> addresses = RandomAddresses(200, 7);
  for (uint64_t a : addresses) table.Add(a, 32);
  table.SetSlotLocked(HandTable::BucketOf(addresses[0]) % HD_SEQ_SLOTS, true);
  std::vector<hd_live_block> blocks;
  EXPECT_EQ(table.Snapshot(&blocks, false), HD_READ_ERR_BUSY);
  hd_read_limits final_table = {};
  final_table.final = true;
  ASSERT_EQ(table.Snapshot(&blocks, false, &final_table), HD_READ_OK);
  EXPECT_EQ(AddressesOf(blocks), std::multiset<uint64_t>(addresses.begin(), addresses.end()));
  EXPECT_EQ(final_table.torn_slots, 0u);
}

// A dead writer's locked slot whose chain it left broken costs that slot's blocks, not the
// snapshot; a broken chain in a slot it had released is still corruption.
TEST(TableReader, ABrokenChainInAFinalTableFailsOnlyWhereItsWriterDied) {
  HandTable table;
  const std::vector<uint64_t> addresses = RandomAddresses(200, 8);
  for (uint64_t a : addresses) table.Add(a, 32);
  const uint64_t torn = HandTable::BucketOf(addresses[0]);
  table.Add(addresses[0], 64);  // a duplicate: the new node linked, the old not yet unlinked
  hd_read_limits final_table = {};
  final_table.final = true;
  std::vector<hd_live_block> blocks;
  EXPECT_EQ(table.Snapshot(&blocks, false, &final_table), HD_READ_ERR_CORRUPT);
  table.SetSlotLocked(torn % HD_SEQ_SLOTS, true);
  ASSERT_EQ(table.Snapshot(&blocks, false, &final_table), HD_READ_OK);
  EXPECT_EQ(final_table.torn_slots, 1u);
  std::multiset<uint64_t> expected;
  for (uint64_t a : addresses) {
    if (HandTable::BucketOf(a) % HD_SEQ_SLOTS != torn % HD_SEQ_SLOTS) expected.insert(a);
  }
  EXPECT_EQ(AddressesOf(blocks), expected);
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
      for (int i = 0; i < 80 && !done; i++) usleep(10000);  // 0.8 s
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
