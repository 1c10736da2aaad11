// The collector's walk over glibc's heaps (collector/glibc_heap.c), which finds the blocks a
// sampled or armed process did not record, on heaps laid out here as glibc's chunk headers
// describe them and read as the collector reads a process's: the roots it finds for a known
// layout (the main arena's, a thread arena's first heap, a block mmapped on its own), and on
// heaps of random words that it stays inside the heap and ends.
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "glibc_heap_probe.h"

namespace {

constexpr uint64_t kPrevInUse = 1, kMmapped = 2;
constexpr uint64_t kArenaHeapAlign = uint64_t{64} << 20;

// Memory at an address aligned to kArenaHeapAlign, as a thread arena's heap is.
class Aligned {
 public:
  Aligned() {
    raw_ = mmap(nullptr, 2 * kArenaHeapAlign, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    EXPECT_NE(raw_, MAP_FAILED);
    const uint64_t at =
        (reinterpret_cast<uint64_t>(raw_) + kArenaHeapAlign - 1) & ~(kArenaHeapAlign - 1);
    base = reinterpret_cast<uint8_t *>(at);
  }
  ~Aligned() { munmap(raw_, 2 * kArenaHeapAlign); }
  uint8_t *base;

 private:
  void *raw_;
};

// Chunks laid out one after another from `at`: each header's size with the previous chunk's
// PREV_INUSE bit, as glibc keeps them.
class Layout {
 public:
  Layout(uint8_t *heap, uint64_t first) : heap_(heap), at_(first) {}
  // A chunk of size bytes; the address of its user bytes.
  uint64_t Chunk(uint64_t size, bool in_use) {
    const uint64_t chunk = at_;
    Word(chunk + 8) = size | (previous_in_use_ ? kPrevInUse : 0);
    previous_in_use_ = in_use;
    at_ += size;
    return Address(chunk) + 16;
  }
  uint64_t Address(uint64_t offset) const { return reinterpret_cast<uint64_t>(heap_) + offset; }
  uint64_t &Word(uint64_t offset) { return *reinterpret_cast<uint64_t *>(heap_ + offset); }
  uint64_t at() const { return at_; }

 private:
  uint8_t *heap_;
  uint64_t at_;
  bool previous_in_use_ = true;
};

struct Walk {
  std::vector<hd_probe_range> roots, glibc;
};

Walk Probe(const void *heap, size_t size, bool main_arena, const std::vector<uint64_t> &blocks) {
  Walk w;
  w.roots.resize(64);
  hd_probe_range glibc[16];
  size_t glibc_count = 0;
  const size_t n = hd_probe_glibc_heap(heap, size, main_arena, true, blocks.data(), blocks.size(),
                                       w.roots.data(), w.roots.size(), glibc, &glibc_count);
  EXPECT_NE(n, SIZE_MAX);
  w.roots.resize(n < w.roots.size() ? n : w.roots.size());
  w.glibc.assign(glibc, glibc + glibc_count);
  return w;
}

}  // namespace

bool operator==(const hd_probe_range &a, const hd_probe_range &b) {
  return a.start == b.start && a.end == b.end;
}
std::ostream &operator<<(std::ostream &out, const hd_probe_range &r) {
  return out << std::hex << "[" << r.start << ", " << r.end << ")";
}

// The program break's heap: runs of in-use chunks that hold no recorded block are roots, each
// to the next chunk's first word (the last chunk's, in use, may hold bytes there); a recorded
// block and a free chunk (its stale pointer included) end a run; the top chunk is free.
TEST(GlibcHeap, TheMainArenasUnrecordedBlocksAreRoots) {
  alignas(4096) static uint8_t heap[4096];
  memset(heap, 0, sizeof heap);
  Layout l(heap, 0);
  const uint64_t a = l.Chunk(32, true);
  const uint64_t b = l.Chunk(48, true);
  const uint64_t c = l.Chunk(64, false);
  l.Word(c - l.Address(0)) = b;  // a stale pointer in a free chunk
  const uint64_t d = l.Chunk(32, true);
  l.Chunk(48, true);
  const uint64_t top = l.Chunk(sizeof heap - l.at(), false) - 16;
  const Walk w = Probe(heap, sizeof heap, true, {b});
  const std::vector<hd_probe_range> expected = {{a, b - 8}, {d, top + 8}};
  EXPECT_EQ(w.roots, expected);
  EXPECT_TRUE(w.glibc.empty());  // the break's heap is the allocator's already
}

// A thread arena's first heap: its heap_info (arena right after it) and malloc_state come
// first, scanned whole (bins); its chunks after; the heap's size is heap_info's, not the
// mapping's; the heap is glibc's memory.
TEST(GlibcHeap, AThreadArenasHeapIsFoundByItsHeaderAndWalked) {
  Aligned memory;
  uint8_t *heap = memory.base;
  Layout l(heap, 2256);  // 48 bytes of heap_info, 2200 of malloc_state, aligned to 16
  l.Word(0) = l.Address(48);
  l.Word(16) = 8192;
  const uint64_t x = l.Chunk(32, true);
  const uint64_t y = l.Chunk(64, true);
  const uint64_t top = l.Chunk(8192 - l.at(), false) - 16;
  const Walk w = Probe(heap, 16384, false, {x});
  const std::vector<hd_probe_range> expected = {{l.Address(0), l.Address(2256)}, {y, top + 8}};
  EXPECT_EQ(w.roots, expected);
  const std::vector<hd_probe_range> glibc = {{l.Address(0), l.Address(8192)}};
  EXPECT_EQ(w.glibc, glibc);
}

// A block glibc mapped on its own (IS_MMAPPED): the chunk is glibc's memory, nothing beside it
// is walked.
TEST(GlibcHeap, ABlockMappedOnItsOwnIsGlibcsMemoryAlone) {
  Aligned memory;
  uint8_t *mapping = memory.base + 4096;  // no arena heap starts in it
  Layout l(mapping, 0);
  l.Word(8) = 8192 | kMmapped;
  const Walk w = Probe(mapping, 8192, false, {l.Address(16)});
  EXPECT_TRUE(w.roots.empty());
  const std::vector<hd_probe_range> glibc = {{l.Address(0), l.Address(8192)}};
  EXPECT_EQ(w.glibc, glibc);
}

// Heaps of random words, some shaped like sizes, with random recorded blocks: a process's
// memory is hostile. Every root stays inside the heap and the walk ends.
TEST(GlibcHeap, RandomHeapsYieldRootsInsideTheHeapOnly) {
  Aligned memory;
  std::mt19937_64 random(44);
  for (int round = 0; round < 400; round++) {
    const bool main_arena = round % 2 == 0;
    const uint64_t size = 4096 * (1 + random() % 4);
    uint64_t *words = reinterpret_cast<uint64_t *>(memory.base);
    for (uint64_t i = 0; i < size / 8; i++) {
      const uint64_t r = random();
      words[i] = r % 3 == 0 ? r : r % 3 == 1 ? (r >> 8) % 512 * 16 + r % 8 : (r >> 8) % 512;
    }
    if (!main_arena) words[2] = size;  // heap_info's size, so that the heap is walked
    std::vector<uint64_t> blocks;
    for (int i = 0; i < 8; i++) {
      blocks.push_back(reinterpret_cast<uint64_t>(memory.base) + random() % size / 16 * 16);
    }
    std::sort(blocks.begin(), blocks.end());
    const uint64_t lo = reinterpret_cast<uint64_t>(memory.base), hi = lo + size;
    const Walk w = Probe(memory.base, size, main_arena, blocks);
    for (const hd_probe_range &r : w.roots) {
      EXPECT_TRUE(r.start >= lo && r.start < r.end && r.end <= hi)
          << "round " << round << ": [" << r.start - lo << ", " << r.end - lo << ")";
    }
    for (const hd_probe_range &r : w.glibc) {
      EXPECT_TRUE(r.start >= lo && r.start < r.end && r.end <= hi) << "round " << round;
    }
  }
}
