// The leak check's classification (tools/lib/reach.c) on snapshots built element by element,
// where every pointer is placed by hand: each category's rules, the order-independence of
// definitely and indirectly lost, glibc's thread vector, and what it does without contents.
#include <string.h>

#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/reach.h"

namespace {

// A snapshot of blocks at chosen addresses holding chosen words, and roots holding chosen words.
class Heap {
 public:
  Heap() {
    hd_reassembler_init(&r_);
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_thread_info_tag;
    e.element.thread_info = {true, 1, true, 1, true, "main"};
    Add(e);
    e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_stack_trace_tag;
    e.element.stack_trace.has_stack_trace_key = true;
    e.element.stack_trace.stack_trace_key = 1;
    Add(e);
  }
  ~Heap() { hd_reassembler_destroy(&r_); }

  // A block of size bytes at address; words[i] is the word at offset 8 * i (the rest zero);
  // with_contents false leaves its contents out.
  void Block(uint64_t address, uint64_t size, std::vector<uint64_t> words = {},
             bool with_contents = true) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_allocation_tag;
    e.element.allocation = {true, address, true, size, true, 1, false, 0, true, 1, false, 0};
    Add(e);
    if (!with_contents) return;
    std::vector<uint8_t> bytes(size);
    if (!words.empty())
      memcpy(bytes.data(), words.data(), std::min<size_t>(size, words.size() * 8));
    e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_block_contents_tag;
    e.element.block_contents.has_address = true;
    e.element.block_contents.address = address;
    Add(e, bytes);
  }
  // A root at address whose bytes are words (address need not be aligned).
  void Root(uint64_t address, std::vector<uint64_t> words) {
    std::vector<uint8_t> bytes(words.size() * 8);
    if (!words.empty()) memcpy(bytes.data(), words.data(), bytes.size());
    RootBytes(address, bytes);
  }
  void RootBytes(uint64_t address, const std::vector<uint8_t> &bytes) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_root_region_tag;
    auto &g = e.element.root_region;
    g.has_address = g.has_size = g.has_kind = true;
    g.address = address;
    g.size = bytes.size();
    g.kind = heapdump_client_RootKind_ROOT_KIND_DATA;
    Add(e, bytes);
  }
  // The category of each block, by address.
  std::map<uint64_t, std::string> Classify(size_t *without_contents = nullptr) {
    EXPECT_EQ(hd_reassembler_finish(&r_), HD_OK) << r_.error;
    const hd_snapshot *s = r_.snapshots[0];
    std::vector<uint8_t> categories(s->allocation_count);
    size_t missing = 0;
    EXPECT_EQ(hd_reach_classify(s, categories.data(), &missing), 0);
    if (without_contents != nullptr) *without_contents = missing;
    std::map<uint64_t, std::string> out;
    for (size_t i = 0; i < s->allocation_count; i++) {
      out[s->allocations[i].address] =
          hd_reach_category_name(static_cast<hd_reach_category>(categories[i]));
    }
    return out;
  }
  hd_reassembler *reassembler() { return &r_; }

 private:
  void Add(const heapdump_client_SnapshotElement &e, const std::vector<uint8_t> &bytes = {}) {
    hd_element element = {&e, nullptr, 0, bytes.data(), bytes.size()};
    ASSERT_EQ(hd_reassembler_add(&r_, &element), HD_OK) << r_.error;
  }
  hd_reassembler r_;
};

TEST(Reach, EachCategoryAsValgrindDefinesIt) {
  Heap h;
  h.Root(0x1000, {0, 0xa000, 42});        // a start pointer to A, and a number
  h.Block(0xa000, 32, {0xb000, 0xc010});  // A -> B (start), -> C (interior)
  h.Block(0xb000, 16);                    // reachable through start pointers only
  h.Block(0xc000, 64, {0xd000});          // possibly lost; its D too
  h.Block(0xd000, 16);
  h.Block(0xe000, 16, {0xf000});  // E <-> F: a lost cycle
  h.Block(0xf000, 16, {0xe000});
  h.Block(0x10000, 24, {0x11008});  // G lost, points into H
  h.Block(0x11000, 16);
  h.Block(0x12000, 8, {0x12000});  // points to itself only: definitely lost
  auto c = h.Classify();
  EXPECT_EQ(c[0xa000], "still_reachable");
  EXPECT_EQ(c[0xb000], "still_reachable");
  EXPECT_EQ(c[0xc000], "possibly_lost");
  EXPECT_EQ(c[0xd000], "possibly_lost");
  EXPECT_EQ(c[0xe000], "definitely_lost");  // the first of the cycle, in address order
  EXPECT_EQ(c[0xf000], "indirectly_lost");
  EXPECT_EQ(c[0x10000], "definitely_lost");
  EXPECT_EQ(c[0x11000], "indirectly_lost");
  EXPECT_EQ(c[0x12000], "definitely_lost");
}

// A lost block met before the lost block that points to it is still indirectly lost in the end.
TEST(Reach, APointedToLostBlockIsIndirectlyLostWhateverTheOrder) {
  Heap h;
  h.Root(0x1000, {0});
  h.Block(0x2000, 16, {0x3000});  // J -> K, found first
  h.Block(0x3000, 16);
  h.Block(0x9000, 16, {0x2000});  // I -> J, found last
  auto c = h.Classify();
  EXPECT_EQ(c[0x9000], "definitely_lost");
  EXPECT_EQ(c[0x2000], "indirectly_lost");
  EXPECT_EQ(c[0x3000], "indirectly_lost");
}

// glibc's thread control block points 16 bytes into the thread's dynamic thread vector, whose
// first word counts its entries: that exact shape counts as a start pointer, nothing else does.
TEST(Reach, GlibcsThreadVectorIsReachedThroughItsControlBlock) {
  Heap h;
  h.Root(0x1000, {0x5010, 0x6010});
  h.Block(0x5000, 48, {1});  // 48 bytes: a count of 1 and 2 more entries
  h.Block(0x6000, 48, {7});  // the count does not fit the size
  auto c = h.Classify();
  EXPECT_EQ(c[0x5000], "still_reachable");
  EXPECT_EQ(c[0x6000], "possibly_lost");
}

// Words are the aligned ones, wherever a root starts; an unaligned pointer is no pointer.
TEST(Reach, RootsAreScannedByAlignedWords) {
  Heap h;
  std::vector<uint8_t> bytes(4 + 16, 0);
  uint64_t a = 0x7000, b = 0x8000;
  memcpy(&bytes[4], &a, 8);   // at 0x1008: aligned
  memcpy(&bytes[13], &b, 7);  // at 0x1011: not aligned (and cut)
  h.RootBytes(0x1004, bytes);
  h.Block(0x7000, 16);
  h.Block(0x8000, 16);
  auto c = h.Classify();
  EXPECT_EQ(c[0x7000], "still_reachable");
  EXPECT_EQ(c[0x8000], "definitely_lost");
}

// A block without contents points nowhere (and is counted); zero-size blocks are reached by
// their address.
TEST(Reach, BlocksWithoutContentsPointNowhere) {
  Heap h;
  h.Root(0x1000, {0x2000, 0x4000});
  h.Block(0x2000, 16, {0x3000}, /*with_contents=*/false);
  h.Block(0x3000, 16);
  h.Block(0x4000, 0);
  size_t missing = 0;
  auto c = h.Classify(&missing);
  EXPECT_EQ(missing, 1u);
  EXPECT_EQ(c[0x2000], "still_reachable");
  EXPECT_EQ(c[0x3000], "definitely_lost");
  EXPECT_EQ(c[0x4000], "still_reachable");
}

TEST(Reach, ASnapshotWithoutRootsCannotBeClassified) {
  Heap h;
  h.Block(0x2000, 16);
  ASSERT_EQ(hd_reassembler_finish(h.reassembler()), HD_OK);
  const hd_snapshot *s = h.reassembler()->snapshots[0];
  EXPECT_FALSE(hd_reach_possible(s));
  uint8_t category;
  EXPECT_EQ(hd_reach_classify(s, &category, nullptr), -EINVAL);
}

}  // namespace
