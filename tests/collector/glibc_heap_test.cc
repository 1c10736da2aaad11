// The collector's walk over glibc's heaps (collector/glibc_heap.c), which finds the blocks a
// sampled or armed process did not record, read as the collector reads a process's memory:
// on heaps laid out here as glibc's chunk headers describe them (the main arena's, a thread
// arena's first and later heaps, glibc before 2.35, a block mapped on its own, a free chunk read
// mid-change, a first chunk that is not where glibc puts it), on heaps of random words (it stays
// inside the heap and ends), and on this process's own glibc heaps (the layout it assumes is
// glibc's: every unrecorded live block is in a root, no recorded one is).
#include <malloc.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "glibc_heap_probe.h"

namespace {

constexpr uint64_t kPrevInUse = 1, kMmapped = 2;
constexpr uint64_t kArenaHeapAlign = uint64_t{64} << 20;

// Memory at an address aligned to kArenaHeapAlign, as a thread arena's heaps are: two of them.
class Aligned {
 public:
  Aligned() {
    raw_ = mmap(nullptr, 3 * kArenaHeapAlign, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    EXPECT_NE(raw_, MAP_FAILED);
    const uint64_t at =
        (reinterpret_cast<uint64_t>(raw_) + kArenaHeapAlign - 1) & ~(kArenaHeapAlign - 1);
    base = reinterpret_cast<uint8_t *>(at);
  }
  ~Aligned() { munmap(raw_, 3 * kArenaHeapAlign); }
  uint8_t *base;

 private:
  void *raw_;
};

// Chunks laid out one after another from `first` in a heap of `size` bytes, as glibc keeps
// them: each header's size with the previous chunk's PREV_INUSE bit, a free chunk's size
// repeated in the next chunk's first word.
class Layout {
 public:
  Layout(uint8_t *heap, uint64_t size, uint64_t first) : heap_(heap), size_(size), at_(first) {}
  // A chunk of size bytes; the address of its user bytes.
  uint64_t Chunk(uint64_t size, bool in_use, bool footer = true) {
    const uint64_t chunk = at_;
    Word(chunk + 8) = size | (previous_in_use_ ? kPrevInUse : 0);
    if (!in_use && footer && chunk + size < size_) Word(chunk + size) = size;
    previous_in_use_ = in_use;
    at_ += size;
    return Address(chunk) + 16;
  }
  // The last chunk, free, to the heap's end; its address.
  uint64_t Top() { return Chunk(size_ - at_, false) - 16; }
  uint64_t Address(uint64_t offset) const { return reinterpret_cast<uint64_t>(heap_) + offset; }
  uint64_t &Word(uint64_t offset) { return *reinterpret_cast<uint64_t *>(heap_ + offset); }

 private:
  uint8_t *heap_;
  uint64_t size_, at_;
  bool previous_in_use_ = true;
};

// A thread arena heap's heap_info: the arena, the previous heap, its size (and the mprotected
// size, the page size where glibc 2.35 on keeps it).
void HeapInfo(Layout &l, uint64_t arena, uint64_t prev, uint64_t size, bool page_size = true) {
  l.Word(0) = arena;
  l.Word(8) = prev;
  l.Word(16) = size;
  l.Word(24) = size;
  if (page_size) l.Word(32) = 4096;
}

struct Walk {
  std::vector<hd_probe_range> roots, glibc;
};

// The walk over the mappings of process pid, with the recorded blocks given.
Walk ProbeMappings(pid_t pid, const std::vector<hd_probe_mapping> &maps,
                   std::vector<uint64_t> blocks) {
  std::sort(blocks.begin(), blocks.end());
  Walk w;
  w.roots.resize(1 << 20);
  hd_probe_range glibc[16];
  size_t glibc_count = 0;
  const size_t n =
      hd_probe_glibc_heap(pid, maps.data(), maps.size(), true, blocks.data(), blocks.size(),
                          w.roots.data(), w.roots.size(), glibc, &glibc_count);
  EXPECT_NE(n, SIZE_MAX);
  EXPECT_LE(n, w.roots.size());
  w.roots.resize(std::min(n, w.roots.size()));
  w.glibc.assign(glibc, glibc + glibc_count);
  return w;
}

// The walk over one mapping of this process, [heap, heap + size).
Walk Probe(const void *heap, size_t size, bool main_arena, const std::vector<uint64_t> &blocks) {
  const uint64_t start = reinterpret_cast<uint64_t>(heap);
  return ProbeMappings(getpid(), {{start, start + size, main_arena}}, blocks);
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
  Layout l(heap, sizeof heap, 0);
  const uint64_t a = l.Chunk(32, true);
  const uint64_t b = l.Chunk(48, true);
  const uint64_t c = l.Chunk(64, false);
  l.Word(c - l.Address(0)) = b;  // a stale pointer in a free chunk
  const uint64_t d = l.Chunk(32, true);
  l.Chunk(48, true);
  const uint64_t top = l.Top();
  const Walk w = Probe(heap, sizeof heap, true, {b});
  const std::vector<hd_probe_range> expected = {{a, b - 8}, {d, top + 8}};
  EXPECT_EQ(w.roots, expected);
  EXPECT_TRUE(w.glibc.empty());  // the break's heap is the allocator's already
}

// A chunk marked free whose size the next chunk does not repeat was read while the process
// changed it: it is scanned, as in use.
TEST(GlibcHeap, AFreeChunkWithoutItsFooterIsScanned) {
  alignas(4096) static uint8_t heap[4096];
  memset(heap, 0, sizeof heap);
  Layout l(heap, sizeof heap, 0);
  const uint64_t a = l.Chunk(32, true);
  l.Chunk(64, false, false);
  l.Chunk(32, true);
  const uint64_t top = l.Top();
  const Walk w = Probe(heap, sizeof heap, true, {});
  const std::vector<hd_probe_range> expected = {{a, top + 8}};
  EXPECT_EQ(w.roots, expected);
}

// A thread arena's first heap: its heap_info (the arena right after it, no previous heap) and
// malloc_state come first, scanned whole (the bins); its chunks after; the heap's size is
// heap_info's, not the mapping's; the heap is glibc's memory.
TEST(GlibcHeap, AThreadArenasFirstHeapIsFoundByItsHeaderAndWalked) {
  Aligned memory;
  uint8_t *heap = memory.base;
  Layout l(heap, 8192, 2256);  // 48 bytes of heap_info, 2200 of malloc_state, aligned to 16
  HeapInfo(l, l.Address(48), 0, 8192);
  const uint64_t x = l.Chunk(32, true);
  const uint64_t y = l.Chunk(64, true);
  const uint64_t top = l.Top();
  const Walk w = Probe(heap, 16384, false, {x});
  const std::vector<hd_probe_range> expected = {{l.Address(0), l.Address(2256)}, {y, top + 8}};
  EXPECT_EQ(w.roots, expected);
  const std::vector<hd_probe_range> glibc = {{l.Address(0), l.Address(8192)}};
  EXPECT_EQ(w.glibc, glibc);
}

// An arena's later heap (its arena in another heap, which it links back to) starts its chunks
// right after its heap_info; glibc before 2.35 had a 32-byte heap_info.
TEST(GlibcHeap, AnArenasLaterHeapAndOlderGlibcsHeapInfo) {
  Aligned memory;
  for (const bool older : {false, true}) {
    uint8_t *heap = memory.base + kArenaHeapAlign;
    memset(heap, 0, 8192);
    const uint64_t header = older ? 32 : 48;
    Layout l(heap, 8192, header);
    const uint64_t other = reinterpret_cast<uint64_t>(memory.base);
    HeapInfo(l, other + header, other, 8192, !older);
    const uint64_t x = l.Chunk(32, true);
    const uint64_t y = l.Chunk(48, true);
    const uint64_t top = l.Top();
    const Walk w = Probe(heap, 8192, false, {y});
    const std::vector<hd_probe_range> expected = {{l.Address(0), l.Address(header)}, {x, y - 8}};
    EXPECT_EQ(w.roots, std::vector<hd_probe_range>(expected)) << "older " << older;
    (void)top;
  }
}

// Where the first chunk is not where glibc puts it (the chain from there misses the first
// recorded block), what lies before that block is scanned whole and the walk starts at it.
TEST(GlibcHeap, AFirstChunkNotWhereGlibcPutsItIsScannedWhole) {
  alignas(4096) static uint8_t heap[4096];
  memset(heap, 0, sizeof heap);
  Layout l(heap, sizeof heap, 256);  // 256 bytes of something before the chunks
  const uint64_t a = l.Chunk(32, true);
  const uint64_t b = l.Chunk(64, true);
  const uint64_t top = l.Top();
  const Walk w = Probe(heap, sizeof heap, true, {a});
  const std::vector<hd_probe_range> expected = {{l.Address(0), a - 8}, {b, top + 8}};
  EXPECT_EQ(w.roots, expected);
}

// Two thread-arena heaps the kernel shows as one mapping, only the first holding a recorded
// block: both are glibc's memory, and both are walked (the second's blocks are unrecorded too).
// The second heap grew past the mapping as it was read: its end is the mapping's, and its last
// chunk, cut there, is scanned.
TEST(GlibcHeap, HeapsMergedInOneMappingAreAllFoundAndOneCutShortIsScanned) {
  Aligned memory;
  uint8_t *first_heap = memory.base, *second_heap = memory.base + kArenaHeapAlign;
  memset(first_heap, 0, 8192);
  memset(second_heap, 0, 8192);
  Layout one(first_heap, 8192, 2256);
  HeapInfo(one, one.Address(48), 0, 8192);
  const uint64_t x = one.Chunk(32, true);
  one.Top();
  Layout two(second_heap, 8192, 48);
  HeapInfo(two, one.Address(48), one.Address(0), 8192);
  const uint64_t y = two.Chunk(32, true);
  two.Chunk(4096, true);  // past 4096 + 48 + 32: cut by the mapping's end below
  const size_t mapping = kArenaHeapAlign + 4096;
  const Walk w = Probe(first_heap, mapping, false, {x});
  const std::vector<hd_probe_range> glibc = {{one.Address(0), one.Address(8192)},
                                             {two.Address(0), two.Address(4096)}};
  EXPECT_EQ(w.glibc, glibc);
  // y's run ends at the cut chunk's first word; the cut chunk, from its header, is scanned to
  // the mapping's end (the collector merges the two).
  const std::vector<hd_probe_range> expected = {{one.Address(0), one.Address(2256)},
                                                {two.Address(0), two.Address(48)},
                                                {y, two.Address(48 + 32 + 8)},
                                                {two.Address(48 + 32), two.Address(4096)}};
  EXPECT_EQ(w.roots, expected);
}

// A block glibc mapped on its own (IS_MMAPPED): the chunk is glibc's memory, nothing beside it
// is walked.
TEST(GlibcHeap, ABlockMappedOnItsOwnIsGlibcsMemoryAlone) {
  Aligned memory;
  uint8_t *mapping = memory.base + 4096;  // no arena heap starts in it
  Layout l(mapping, 8192, 0);
  l.Word(8) = 8192 | kMmapped;
  const Walk w = Probe(mapping, 8192, false, {l.Address(16)});
  EXPECT_TRUE(w.roots.empty());
  const std::vector<hd_probe_range> glibc = {{l.Address(0), l.Address(8192)}};
  EXPECT_EQ(w.glibc, glibc);
}

// Heaps of random words, some shaped like sizes and heap_infos, with random recorded blocks: a
// process's memory is hostile. Every root stays inside the heap and the walk ends.
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
    const uint64_t lo = reinterpret_cast<uint64_t>(memory.base), hi = lo + size;
    if (!main_arena) {  // a heap_info that holds, so that the heap is walked
      words[0] = lo + 48;
      words[1] = 0;
      words[2] = words[3] = size;
      words[4] = 4096;
    }
    std::vector<uint64_t> blocks;
    for (int i = 0; i < 8; i++) blocks.push_back(lo + random() % size / 16 * 16);
    std::sort(blocks.begin(), blocks.end());
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

// glibc itself: a child process allocates blocks of many sizes in its main arena and in another
// thread's arena, frees some, and stops; one block in fifty is taken as recorded. In the
// child's heaps, every other live block lies in a root and no recorded one does, and the thread
// arena's first heap is walked from where glibc_heap.c assumes glibc puts its first chunk (its
// header scanned whole up to there, not further).
TEST(GlibcHeap, GlibcsOwnHeapsAreWalkedAsLaidOut) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizer's allocator stands in for glibc's in this build";
#endif
  struct Shared {
    size_t count;
    uint64_t address[40000], usable[40000];
  };
  auto *shared = static_cast<Shared *>(
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(shared, MAP_FAILED);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = fork();
  if (child == 0) {
    auto allocate = [shared](unsigned seed) {
      std::mt19937 random(seed);
      std::vector<void *> mine(20000);
      for (void *&p : mine) p = malloc(16 + random() % 2000);
      for (size_t i = 0; i < mine.size(); i++) {
        if (i % 3 == 0) {
          free(mine[i]);
        } else if (shared->count < 40000) {
          shared->address[shared->count] = reinterpret_cast<uint64_t>(mine[i]);
          shared->usable[shared->count++] = malloc_usable_size(mine[i]);
        }
      }
    };
    allocate(1);
    std::thread other(allocate, 2);
    other.join();
    if (write(ready[1], "r", 1) != 1) _exit(1);
    pause();
    _exit(0);
  }
  ASSERT_GT(child, 0);
  char byte;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  std::vector<uint64_t> recorded;
  for (size_t i = 0; i < shared->count; i += 50) recorded.push_back(shared->address[i]);
  std::sort(recorded.begin(), recorded.end());
  // Its writable mappings, as the collector reads them: the break's heap (the kernel may show
  // it in several pieces) and the anonymous ones, the thread arena's among them.
  std::vector<hd_probe_mapping> heaps;
  FILE *maps = fopen(("/proc/" + std::to_string(child) + "/maps").c_str(), "r");
  ASSERT_NE(maps, nullptr);
  char line[512];
  while (fgets(line, sizeof line, maps) != nullptr) {
    unsigned long long start, end;
    char perms[8];
    int name_at = 0;
    if (sscanf(line, "%llx-%llx %7s %*s %*s %*s %n", &start, &end, perms, &name_at) < 3) continue;
    const bool brk = strncmp(line + name_at, "[heap]", 6) == 0;
    const bool anonymous = line[name_at] == '\n' || line[name_at] == '\0';
    if (strcmp(perms, "rw-p") == 0 && (brk || anonymous)) heaps.push_back({start, end, brk});
  }
  fclose(maps);
  ASSERT_TRUE(
      std::any_of(heaps.begin(), heaps.end(), [](const hd_probe_mapping &h) { return h.brk; }));
  Walk w = ProbeMappings(child, heaps, recorded);
  std::vector<hd_probe_range> &roots = w.roots;
  bool thread_heap_header = false;
  for (const hd_probe_range &r : roots) {
    if (r.start % kArenaHeapAlign == 0 && r.end == r.start + 2256) thread_heap_header = true;
  }
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  std::sort(roots.begin(), roots.end(),
            [](const hd_probe_range &a, const hd_probe_range &b) { return a.start < b.start; });
  auto covering = [&roots](uint64_t a) {
    auto it = std::upper_bound(roots.begin(), roots.end(), a,
                               [](uint64_t x, const hd_probe_range &r) { return x < r.start; });
    return it != roots.begin() && a < std::prev(it)->end ? &*std::prev(it) : nullptr;
  };
  size_t uncovered = 0, recorded_in_roots = 0;
  for (size_t i = 0; i < shared->count; i++) {
    const uint64_t a = shared->address[i];
    const bool is_recorded = std::binary_search(recorded.begin(), recorded.end(), a);
    const hd_probe_range *r = covering(a);
    if (is_recorded && r != nullptr) recorded_in_roots++;
    if (!is_recorded && (r == nullptr || a + shared->usable[i] > r->end)) uncovered++;
  }
  EXPECT_GT(shared->count, 20000u);
  EXPECT_EQ(uncovered, 0u) << "of " << shared->count;
  EXPECT_EQ(recorded_in_roots, 0u) << "of " << recorded.size();
  EXPECT_TRUE(thread_heap_header);
  munmap(shared, sizeof(Shared));
  close(ready[0]);
  close(ready[1]);
}
