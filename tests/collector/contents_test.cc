// Block contents read from a real child process with hd_read_block_contents: more ranges than one
// call takes, blocks close enough to share a range (some overlapping, as a hostile table may
// have them), a range in which the child unmapped a page after the table was read (blocks freed
// meanwhile), blocks larger than the buffer, blocks that are skipped, an exited process, and a
// consumer that stops the reading.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "contents.h"

namespace {

constexpr size_t kPage = 4096;
constexpr uint64_t kMaxBlock = 3 * HD_CONTENTS_BUFFER_BYTES;

uint8_t Pattern(uintptr_t address) { return static_cast<uint8_t>(address * 31 + (address >> 12)); }

struct Mapping {
  uint8_t *base = nullptr;
  size_t size = 0;
};

struct Collected {
  std::map<uint64_t, std::vector<uint8_t>> blocks;
  size_t calls = 0;
  size_t fail_at = SIZE_MAX;  // the call that answers HD_ERR_CANCELED
};

hd_status Collect(void *ctx, uint64_t address, const uint8_t *bytes, uint64_t size) {
  auto *c = static_cast<Collected *>(ctx);
  if (c->calls++ == c->fail_at) return HD_ERR_CANCELED;
  EXPECT_EQ(c->blocks.count(address), 0u) << "block passed on twice: " << address;
  c->blocks[address].assign(bytes, bytes + size);
  return HD_OK;
}

hd_live_block Block(const uint8_t *address, uint64_t size) {
  hd_live_block b = {};
  b.address = reinterpret_cast<uintptr_t>(address);
  b.size = size;
  return b;
}

class ContentsTest : public ::testing::Test {
 protected:
  std::vector<Mapping> mappings;
  pid_t child = -1;
  int pidfd = -1;
  int release = -1;

  ~ContentsTest() override {
    if (release >= 0) close(release);
    if (child > 0) waitpid(child, nullptr, 0);
    if (pidfd >= 0) close(pidfd);
    for (const Mapping &m : mappings) munmap(m.base, m.size);
  }

  // A mapping filled with Pattern of each byte's address.
  Mapping Map(size_t size) {
    void *p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(p, MAP_FAILED);
    Mapping m = {static_cast<uint8_t *>(p), size};
    for (size_t i = 0; i < size; i++) m.base[i] = Pattern(reinterpret_cast<uintptr_t>(m.base + i));
    mappings.push_back(m);
    return m;
  }

  // Forks a child with the same mappings, which unmaps `freed` (what a program that freed blocks
  // after the table was read did), then waits for the end of the test.
  void StartChild(const std::vector<std::pair<uint8_t *, size_t>> &freed) {
    int ready[2], end[2];
    ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
    ASSERT_EQ(pipe2(end, O_CLOEXEC), 0);
    child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      close(end[1]);
      for (const auto &[address, size] : freed) munmap(address, size);
      char c = 1;
      if (write(ready[1], &c, 1) != 1) _exit(1);
      while (read(end[0], &c, 1) > 0) {
      }
      _exit(0);
    }
    close(ready[1]);
    close(end[0]);
    release = end[1];
    char c;
    ASSERT_EQ(read(ready[0], &c, 1), 1);
    close(ready[0]);
    pidfd = static_cast<int>(syscall(SYS_pidfd_open, child, 0));
    ASSERT_GE(pidfd, 0);
  }

  hd_status Read(const std::vector<hd_live_block> &blocks, Collected *got, uint64_t max_total = 0,
                 bool *cut = nullptr) {
    std::vector<hd_live_block> work = blocks;  // the reader's working memory
    return hd_read_block_contents(child, pidfd, work.data(), work.size(), kMaxBlock, max_total, cut,
                                  Collect, got);
  }
};

TEST_F(ContentsTest, EveryBlockStillMappedIsReadWholeAndTheRestSkipped) {
  std::vector<hd_live_block> blocks;
  std::set<uint64_t> lost;  // freed (unmapped) or skipped: never passed on
  // Far apart: a range each, more of them than one call reads.
  Mapping far = Map(2048 * 1100 + kPage);
  for (size_t i = 0; i < 2048; i++) blocks.push_back(Block(far.base + i * 1100, 24 + i % 50));
  // Close together, some overlapping: one range.
  Mapping close_by = Map(4 * kPage);
  for (size_t i = 0; i < 300; i++) blocks.push_back(Block(close_by.base + i * 40, 16));
  blocks.push_back(Block(close_by.base + 20 * 40 + 3, 100));
  blocks.push_back(Block(close_by.base + 20 * 40 + 5, 20));
  // A ends page 0, B and C are in page 1, which the child unmaps: their range comes back short,
  // and A is read again alone. D, in page 2, is a range of its own.
  Mapping near = Map(3 * kPage);
  blocks.push_back(Block(near.base + kPage - 100, 100));
  blocks.push_back(Block(near.base + kPage, 50));
  blocks.push_back(Block(near.base + kPage + 200, 30));
  blocks.push_back(Block(near.base + 2 * kPage + 10, 40));
  lost.insert({blocks[blocks.size() - 3].address, blocks[blocks.size() - 2].address});
  // Larger than the buffer: read alone; one of them unmapped by the child.
  Mapping big = Map(HD_CONTENTS_BUFFER_BYTES + 12345);
  Mapping big_freed = Map(2 * HD_CONTENTS_BUFFER_BYTES);
  blocks.push_back(Block(big.base + 5, big.size - 5));
  blocks.push_back(Block(big_freed.base, big_freed.size));
  lost.insert(blocks.back().address);
  // Nothing to read, and over the limit.
  blocks.push_back(Block(far.base + 600, 0));
  blocks.push_back(Block(far.base + 700, kMaxBlock + 1));
  lost.insert({blocks[blocks.size() - 2].address, blocks.back().address});
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(5));  // table order is hash order

  StartChild({{near.base + kPage, kPage}, {big_freed.base, big_freed.size}});
  Collected got;
  ASSERT_EQ(Read(blocks, &got), HD_OK);
  EXPECT_EQ(got.blocks.size(), blocks.size() - lost.size());
  for (const hd_live_block &b : blocks) {
    auto it = got.blocks.find(b.address);
    if (lost.count(b.address) != 0) {
      EXPECT_EQ(it, got.blocks.end()) << "freed or skipped block passed on: " << b.address;
      continue;
    }
    ASSERT_NE(it, got.blocks.end()) << "block missing: " << b.address;
    ASSERT_EQ(it->second.size(), b.size) << b.address;
    for (size_t i = 0; i < b.size; i++) {
      ASSERT_EQ(it->second[i], Pattern(b.address + i)) << b.address << " + " << i;
    }
  }
}

TEST_F(ContentsTest, NothingFromAProcessThatHasExited) {
  Mapping m = Map(16 * kPage);
  std::vector<hd_live_block> blocks;
  for (size_t i = 0; i < 100; i++) blocks.push_back(Block(m.base + i * 500, 64));
  StartChild({});
  ASSERT_EQ(kill(child, SIGKILL), 0);
  siginfo_t info;
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT),
            0);  // stays a zombie
  Collected got;
  EXPECT_EQ(Read(blocks, &got), HD_OK);
  EXPECT_TRUE(got.blocks.empty());
}

TEST_F(ContentsTest, AConsumerErrorStopsTheReading) {
  Mapping m = Map(64 * kPage);
  std::vector<hd_live_block> blocks;
  for (size_t i = 0; i < 200; i++) blocks.push_back(Block(m.base + i * 1200, 64));
  StartChild({});
  Collected got;
  got.fail_at = 10;
  EXPECT_EQ(Read(blocks, &got), HD_ERR_CANCELED);
  EXPECT_EQ(got.calls, 11u);
  EXPECT_EQ(got.blocks.size(), 10u);
}

// A table may claim blocks that overlap, each as big as the per-block limit: what one process's
// contents may cost is bounded by a total, past which blocks (in address order) go without.
TEST_F(ContentsTest, TheTotalPassedOnIsBounded) {
  Mapping m = Map(4 * kPage);
  std::vector<hd_live_block> blocks;
  for (size_t i = 0; i < 100; i++)
    blocks.push_back(Block(m.base + i * 16, 2 * kPage));  // overlapping
  StartChild({});
  Collected got;
  bool cut = false;
  EXPECT_EQ(Read(blocks, &got, 5 * 2 * kPage, &cut), HD_OK);
  EXPECT_TRUE(cut);
  EXPECT_EQ(got.blocks.size(), 5u);
  EXPECT_EQ(got.blocks.begin()->first, reinterpret_cast<uintptr_t>(m.base));  // the lowest first
  Collected all;
  EXPECT_EQ(Read(blocks, &all, 0, &cut), HD_OK);
  EXPECT_FALSE(cut);
  EXPECT_EQ(all.blocks.size(), 100u);
}

}  // namespace
