// Tests of the dartheap writer: snapshots built element by element through the reassembler, and
// a real process under LD_PRELOAD with a real collector, written as dartheap and read back with
// the independent reader (dartheap_reader.h), whose Check() must find nothing wrong. Also tests
// that the reader's Check() catches each broken invariant.
#include <errno.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "dartheap_reader.h"

extern "C" {
#include "heapdump/fidl/channel.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/dartheap.h"
#include "heapdump/tools/sites.h"
#include "heapdump/tools/symbolize.h"
#include "heapdump_client.bindings.h"
}
#include "client.h"
#include "process.h"

namespace {

using dartheap::Graph;

// ---- snapshots built element by element ----

class Snapshots {
 public:
  Snapshots() { hd_reassembler_init(&ra_); }
  ~Snapshots() { hd_reassembler_destroy(&ra_); }
  Snapshots(const Snapshots &) = delete;
  Snapshots &operator=(const Snapshots &) = delete;

  const hd_reassembler *ra() const { return &ra_; }
  const hd_snapshot *snapshot(size_t i) const { return ra_.snapshots[i]; }

  void Header(const char *process, uint64_t pid) {
    auto e = Element(heapdump_client_SnapshotElement_snapshot_header_tag);
    auto &h = e.element.snapshot_header;
    h.has_process_name = h.has_process_koid = true;
    snprintf(h.process_name, sizeof h.process_name, "%s", process);
    h.process_koid = pid;
    Add(e);
  }
  void Region(uint64_t address, uint64_t size, const char *path) {
    auto e = Element(heapdump_client_SnapshotElement_executable_region_tag);
    auto &g = e.element.executable_region;
    g.has_address = g.has_size = g.has_file_offset = g.has_vaddr = g.has_name = true;
    g.address = address;
    g.size = size;
    snprintf(g.name, sizeof g.name, "%s", path);
    Add(e);
  }
  void Thread(uint64_t key, const char *name) {
    auto e = Element(heapdump_client_SnapshotElement_thread_info_tag);
    auto &t = e.element.thread_info;
    t.has_thread_info_key = t.has_koid = t.has_name = true;
    t.thread_info_key = key;
    t.koid = key;
    snprintf(t.name, sizeof t.name, "%s", name);
    Add(e);
  }
  void Trace(uint64_t key, const std::vector<uint64_t> &addresses) {
    auto e = Element(heapdump_client_SnapshotElement_stack_trace_tag);
    e.element.stack_trace.has_stack_trace_key = true;
    e.element.stack_trace.stack_trace_key = key;
    Add(e, addresses.data(), addresses.size());
  }
  void Block(uint64_t address, uint64_t size, uint64_t trace, int64_t timestamp = 1) {
    auto e = Element(heapdump_client_SnapshotElement_allocation_tag);
    auto &a = e.element.allocation;
    a.has_address = a.has_size = a.has_stack_trace_key = a.has_timestamp = true;
    a.has_thread_info_key = true;
    a.address = address;
    a.size = size;
    a.stack_trace_key = trace;
    a.timestamp = timestamp;
    a.thread_info_key = 1;
    Add(e);
  }
  void Contents(uint64_t address, const std::vector<uint8_t> &bytes) {
    auto e = Element(heapdump_client_SnapshotElement_block_contents_tag);
    e.element.block_contents.has_address = true;
    e.element.block_contents.address = address;
    Add(e, nullptr, 0, bytes.data(), bytes.size());
  }
  // A block whose contents are these little-endian words.
  void BlockOfWords(uint64_t address, const std::vector<uint64_t> &words, uint64_t trace,
                    int64_t timestamp = 1) {
    Block(address, words.size() * 8, trace, timestamp);
    Contents(address, Words(words));
  }
  void Finish() { ASSERT_EQ(hd_reassembler_finish(&ra_), HD_OK) << ra_.error; }

  static std::vector<uint8_t> Words(const std::vector<uint64_t> &words) {
    std::vector<uint8_t> bytes;
    for (uint64_t w : words) {
      for (int i = 0; i < 8; i++) bytes.push_back(static_cast<uint8_t>(w >> (8 * i)));
    }
    return bytes;
  }

 private:
  static heapdump_client_SnapshotElement Element(pb_size_t tag) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = tag;
    return e;
  }
  void Add(const heapdump_client_SnapshotElement &e, const uint64_t *addresses = nullptr,
           size_t address_count = 0, const uint8_t *contents = nullptr, size_t size = 0) {
    hd_element element = {&e, addresses, address_count, contents, size};
    ASSERT_EQ(hd_reassembler_add(&ra_, &element), HD_OK) << ra_.error;
  }

  hd_reassembler ra_;
};

struct Written {
  int rc = 0;
  std::string error;
  std::string bytes;
};

Written Write(const hd_reassembler *ra, hd_dartheap_options *options = nullptr) {
  Written w;
  char *buf = nullptr;
  size_t size = 0;
  FILE *out = open_memstream(&buf, &size);
  char error[256] = "";
  w.rc = hd_dartheap_write(ra, options, out, error, sizeof error);
  fclose(out);
  w.bytes.assign(buf, size);
  free(buf);
  w.error = error;
  return w;
}

// Writes, parses and checks every invariant; the graph is valid only if no assertion failed.
Graph WriteAndRead(const hd_reassembler *ra, hd_dartheap_options *options = nullptr) {
  Graph g;
  Written w = Write(ra, options);
  EXPECT_EQ(w.rc, 0) << w.error;
  std::string error;
  EXPECT_TRUE(dartheap::Parse(w.bytes, &g, &error)) << error;
  EXPECT_EQ(dartheap::CheckReport(g), "");
  return g;
}

// Object ids of a snapshot's blocks, as documented: the blocks of the snapshots in order, each
// snapshot's by address, after the root (object 1).
std::map<uint64_t, uint64_t> IdsByAddress(const hd_reassembler *ra, size_t snapshot) {
  uint64_t first = 2;
  for (size_t k = 0; k < snapshot; k++) first += ra->snapshots[k]->allocation_count;
  const hd_snapshot *s = ra->snapshots[snapshot];
  std::vector<uint64_t> addresses;
  for (size_t i = 0; i < s->allocation_count; i++) addresses.push_back(s->allocations[i].address);
  std::sort(addresses.begin(), addresses.end());
  std::map<uint64_t, uint64_t> ids;
  for (size_t i = 0; i < addresses.size(); i++) ids[addresses[i]] = first + i;
  return ids;
}

std::vector<uint64_t> RefsOf(const Graph &g, uint64_t id) { return g.object(id).references; }

constexpr uint64_t kAppBase = 0x400000;
constexpr uint64_t kAppSite = kAppBase + 0x1234;
constexpr uint64_t kHeap = 0x10000000;

// One module, one thread, one trace: enough for blocks to be valid.
void AddProgram(Snapshots &s) {
  s.Region(kAppBase, 0x10000, "/usr/lib/libapp.so");
  s.Thread(1, "main");
  s.Trace(1, {kAppSite});
}

// ---- references ----

TEST(DartheapWriter, ReferencesAreExactlyThePointersIntoLiveBlocks) {
  Snapshots s;
  AddProgram(s);
  // A linked list L0 -> L1 -> L2 -> L3 (next, value).
  uint64_t list[4];
  for (int i = 0; i < 4; i++) list[i] = kHeap + 0x100 * i;
  for (int i = 0; i < 4; i++) s.BlockOfWords(list[i], {i < 3 ? list[i + 1] : 0, uint64_t(i)}, 1);
  // A complete binary tree of 7 nodes in heap order (left, right, value).
  uint64_t tree[7];
  for (int i = 0; i < 7; i++) tree[i] = kHeap + 0x1000 + 0x100 * i;
  for (int i = 0; i < 7; i++) {
    s.BlockOfWords(
        tree[i],
        {2 * i + 1 < 7 ? tree[2 * i + 1] : 0, 2 * i + 2 < 7 ? tree[2 * i + 2] : 0, uint64_t(i)}, 1);
  }
  // A cycle R0 -> R1 -> R2 -> R0 (value, next) that nothing else references.
  uint64_t ring[3] = {kHeap + 0x2200, kHeap + 0x2000, kHeap + 0x2100};
  for (int i = 0; i < 3; i++) s.BlockOfWords(ring[i], {uint64_t(i), ring[(i + 1) % 3]}, 1);
  // A pointer into the middle of a 64-byte buffer, and one to its last byte.
  const uint64_t holder = kHeap + 0x3000, buffer = kHeap + 0x3100;
  s.BlockOfWords(holder, {7, buffer + 35}, 1);
  s.Block(buffer, 64, 1);
  s.Contents(buffer, std::vector<uint8_t>(64, 0xab));
  // Words that are not references: one past the end of a block, below every block, past the
  // buffer's end; and a reference to itself.
  const uint64_t odd = kHeap + 0x4000;
  s.BlockOfWords(odd, {list[0] + 16, odd, kHeap - 1, buffer + 63, buffer + 64}, 1);
  // A 13-byte block: its second word is incomplete, so only the first is scanned.
  const uint64_t short_block = kHeap + 0x5000;
  std::vector<uint8_t> short_bytes = Snapshots::Words({list[1], tree[3]});
  short_bytes.resize(13);
  s.Block(short_block, 13, 1);
  s.Contents(short_block, short_bytes);
  // A pointer stored at an unaligned offset is not a word the program can follow.
  const uint64_t unaligned = kHeap + 0x6000;
  std::vector<uint8_t> unaligned_bytes(24, 0);
  for (int i = 0; i < 8; i++) unaligned_bytes[4 + i] = static_cast<uint8_t>(list[2] >> (8 * i));
  s.Block(unaligned, 24, 1);
  s.Contents(unaligned, unaligned_bytes);
  // malloc(0) gives a block of size 0 that a pointer still refers to.
  const uint64_t empty = kHeap + 0x7000, to_empty = kHeap + 0x7100;
  s.Block(empty, 0, 1);
  s.BlockOfWords(to_empty, {empty}, 1);
  s.Finish();

  Graph g = WriteAndRead(s.ra());
  auto id = IdsByAddress(s.ra(), 0);
  ASSERT_EQ(g.objects.size(), 1 + s.snapshot(0)->allocation_count);
  for (int i = 0; i < 3; i++) {
    EXPECT_EQ(RefsOf(g, id[list[i]]), std::vector<uint64_t>{id[list[i + 1]]});
  }
  EXPECT_TRUE(RefsOf(g, id[list[3]]).empty());
  for (int i = 0; i < 3; i++) {
    EXPECT_EQ(RefsOf(g, id[tree[i]]),
              (std::vector<uint64_t>{id[tree[2 * i + 1]], id[tree[2 * i + 2]]}));
  }
  for (int i = 3; i < 7; i++) EXPECT_TRUE(RefsOf(g, id[tree[i]]).empty());
  for (int i = 0; i < 3; i++) {
    EXPECT_EQ(RefsOf(g, id[ring[i]]), std::vector<uint64_t>{id[ring[(i + 1) % 3]]});
  }
  EXPECT_EQ(RefsOf(g, id[holder]), std::vector<uint64_t>{id[buffer]});
  EXPECT_TRUE(RefsOf(g, id[buffer]).empty());
  EXPECT_EQ(RefsOf(g, id[odd]), (std::vector<uint64_t>{id[odd], id[buffer]}));
  EXPECT_EQ(RefsOf(g, id[short_block]), std::vector<uint64_t>{id[list[1]]});
  EXPECT_TRUE(RefsOf(g, id[unaligned]).empty());
  EXPECT_EQ(RefsOf(g, id[to_empty]), std::vector<uint64_t>{id[empty]});
  // The root references what no other block references, plus the cycle's lowest id (its lowest
  // address), and nothing else.
  std::vector<uint64_t> root = RefsOf(g, 1);
  std::vector<uint64_t> expected = {id[list[0]], id[tree[0]],     id[ring[1]],   id[holder],
                                    id[odd],     id[short_block], id[unaligned], id[to_empty]};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(root, expected);
  EXPECT_EQ(g.class_of(1).name, "Root");
  EXPECT_EQ(g.class_of(1).Library(), "");
  EXPECT_EQ(g.object(1).shallow_size, 0u);
  uint64_t total = 0;
  for (size_t i = 0; i < s.snapshot(0)->allocation_count; i++) {
    const hd_snapshot_allocation &a = s.snapshot(0)->allocations[i];
    EXPECT_EQ(g.object(id[a.address]).shallow_size, a.size);
    EXPECT_EQ(g.object(id[a.address]).data.tag, dartheap::DataTag::kNone);
    total += a.size;
  }
  EXPECT_EQ(g.shallow_size, total);
  EXPECT_EQ(g.external_size, 0u);
  EXPECT_TRUE(g.external_properties.empty());
  EXPECT_TRUE(g.has_identity_hashes);
}

TEST(DartheapWriter, WithoutContentsTheRootReferencesEveryBlock) {
  Snapshots s;
  AddProgram(s);
  // Addresses that point at each other would be references if contents were there.
  for (uint64_t i = 0; i < 20; i++) s.Block(kHeap + 0x100 * i, 0x100, 1);
  s.Finish();
  Graph g = WriteAndRead(s.ra());
  ASSERT_EQ(g.objects.size(), 21u);
  std::vector<uint64_t> all;
  for (uint64_t id = 2; id <= 21; id++) {
    all.push_back(id);
    EXPECT_TRUE(g.object(id).references.empty());
  }
  EXPECT_EQ(RefsOf(g, 1), all);
  EXPECT_EQ(g.reference_count, 20u);
}

TEST(DartheapWriter, AnEmptySnapshotIsJustTheRoot) {
  Snapshots s;
  AddProgram(s);
  s.Finish();
  Graph g = WriteAndRead(s.ra());
  ASSERT_EQ(g.objects.size(), 1u);
  EXPECT_EQ(g.classes.size(), 1u);
  EXPECT_EQ(g.name, "heapdump");
}

// ---- classes ----

TEST(DartheapWriter, ClassesAreAllocationSitesInTheirModulesLibrary) {
  Snapshots s;
  const uint64_t preload = 0x7f0000000000, prog = 0x500000, nowhere = 0x900000;
  s.Region(kAppBase, 0x10000, "/usr/lib/libapp.so");
  s.Region(preload, 0x10000, "/opt/heapdump/lib/libheapdump.so");
  s.Region(prog, 0x10000, "/home/me/bin/my prog");  // a space, to be escaped in the URI
  s.Thread(1, "main");
  s.Trace(1, {preload + 0x10, kAppSite + 0x20, prog + 0x30});  // the instrumentation is skipped
  s.Trace(2, {kAppSite + 0x20 + 0x1000});                      // another site in libapp.so
  s.Trace(3, {prog + 0x40});
  s.Trace(4, {});             // no stack
  s.Trace(5, {nowhere + 8});  // in no module
  for (uint64_t t = 1; t <= 5; t++) {
    for (uint64_t i = 0; i < 3; i++) s.Block(kHeap + 0x1000 * t + 0x100 * i, 16 * t, t);
  }
  s.Finish();
  Graph g = WriteAndRead(s.ra());
  const hd_snapshot *snap = s.snapshot(0);
  auto id = IdsByAddress(s.ra(), 0);
  ASSERT_EQ(g.classes.size(), 6u);  // the root's and five sites
  std::set<uint64_t> classes;
  for (size_t i = 0; i < snap->allocation_count; i++) {
    const hd_snapshot_allocation &a = snap->allocations[i];
    const hd_snapshot_stack_trace *t = hd_snapshot_find_stack_trace(snap, a.stack_trace_key);
    char site[512];
    hd_site_name(nullptr, snap, t, site, sizeof site);
    std::string module = hd_site_module(nullptr, snap, t);
    const dartheap::Class &c = g.class_of(id[a.address]);
    EXPECT_EQ(c.name, site);
    EXPECT_EQ(c.Library(), "package:" + (module.empty() ? std::string("(no module)") : module));
    classes.insert(g.object(id[a.address]).class_id);
  }
  EXPECT_EQ(classes.size(), 5u);
  const dartheap::Class &app = g.class_of(id[kHeap + 0x1000]);
  EXPECT_EQ(app.library_name, "package:libapp.so");
  EXPECT_EQ(app.library_uri, "package:libapp.so");
  EXPECT_EQ(app.name.rfind("libapp.so+0x", 0), 0u) << app.name;
  const dartheap::Class &spaced = g.class_of(id[kHeap + 0x3000]);
  EXPECT_EQ(spaced.library_name, "package:my prog");
  EXPECT_EQ(spaced.library_uri, "package:my%20prog");
  EXPECT_EQ(g.class_of(id[kHeap + 0x4000]).name, "(no stack)");
  EXPECT_EQ(g.class_of(id[kHeap + 0x4000]).library_uri, "package:%28no%20module%29");
  EXPECT_EQ(g.class_of(id[kHeap + 0x5000]).name, "0x900008");
}

// ---- several processes ----

TEST(DartheapWriter, ProcessesShareOneGraphWithALibraryPerProcess) {
  Snapshots s;
  const char *names[] = {"alpha", "be/ta"};
  for (int p = 0; p < 2; p++) {
    s.Header(names[p], 100 + p);
    AddProgram(s);
    // The same addresses in both processes: A -> B, B -> A's interior, C alone.
    s.BlockOfWords(kHeap, {kHeap + 0x100, 0}, 1);
    s.BlockOfWords(kHeap + 0x100, {kHeap + 8}, 1);
    s.BlockOfWords(kHeap + 0x200, {kHeap}, 1);  // C -> A
  }
  s.Finish();
  Graph g = WriteAndRead(s.ra());
  ASSERT_EQ(g.objects.size(), 7u);
  EXPECT_EQ(g.name, "2 processes");
  for (int p = 0; p < 2; p++) {
    auto id = IdsByAddress(s.ra(), p);
    EXPECT_EQ(RefsOf(g, id[kHeap]), std::vector<uint64_t>{id[kHeap + 0x100]});
    EXPECT_EQ(RefsOf(g, id[kHeap + 0x100]), std::vector<uint64_t>{id[kHeap]});
    EXPECT_EQ(RefsOf(g, id[kHeap + 0x200]), std::vector<uint64_t>{id[kHeap]});
  }
  // C of each process is the one block nothing references.
  EXPECT_EQ(RefsOf(g, 1), (std::vector<uint64_t>{4, 7}));
  EXPECT_EQ(g.class_of(2).library_name, "package:alpha.100/libapp.so");
  EXPECT_EQ(g.class_of(5).library_name, "package:be_ta.101/libapp.so");
  EXPECT_EQ(g.class_of(5).library_uri, "package:be_ta.101/libapp.so");
  EXPECT_EQ(g.class_of(2).name, g.class_of(5).name);
  EXPECT_NE(g.object(2).class_id, g.object(5).class_id);
}

TEST(DartheapWriter, NameComesFromTheProcessOrTheOptions) {
  Snapshots s;
  s.Header("server", 4242);
  AddProgram(s);
  s.Block(kHeap, 8, 1);
  s.Finish();
  EXPECT_EQ(WriteAndRead(s.ra()).name, "server (pid 4242)");
  hd_dartheap_options options = {};
  options.name = "nightly run";
  EXPECT_EQ(WriteAndRead(s.ra(), &options).name, "nightly run");
}

// ---- identity hashes and determinism ----

TEST(DartheapWriter, IdentityHashesAreStableForTheSameAllocation) {
  Snapshots before, after;
  for (Snapshots *s : {&before, &after}) AddProgram(*s);
  // Kept from before to after: 0x0..0x300. Freed: 0x400. New: 0x500, and 0x600 reused by a later
  // allocation at the same address.
  for (uint64_t i = 0; i < 4; i++) {
    before.Block(kHeap + 0x100 * i, 32, 1, 1000 + i);
    after.Block(kHeap + 0x100 * i, 32, 1, 1000 + i);
  }
  before.Block(kHeap + 0x400, 32, 1, 2000);
  before.Block(kHeap + 0x600, 32, 1, 3000);
  after.Block(kHeap + 0x500, 32, 1, 4000);
  after.Block(kHeap + 0x600, 32, 1, 5000);
  before.Finish();
  after.Finish();
  Graph a = WriteAndRead(before.ra()), b = WriteAndRead(after.ra());
  auto ida = IdsByAddress(before.ra(), 0), idb = IdsByAddress(after.ra(), 0);
  ASSERT_TRUE(a.has_identity_hashes && b.has_identity_hashes);
  EXPECT_EQ(a.identity_hash(1), b.identity_hash(1));  // the root
  for (uint64_t i = 0; i < 4; i++) {
    uint64_t address = kHeap + 0x100 * i;
    EXPECT_EQ(a.identity_hash(ida[address]), b.identity_hash(idb[address])) << i;
  }
  EXPECT_NE(a.identity_hash(ida[kHeap + 0x600]), b.identity_hash(idb[kHeap + 0x600]));
  std::set<uint64_t> hashes_a(a.identity_hashes.begin(), a.identity_hashes.end());
  EXPECT_EQ(hashes_a.size(), a.identity_hashes.size());
}

TEST(DartheapWriter, OutputDependsOnlyOnTheSnapshot) {
  Snapshots forward, backward;
  for (Snapshots *s : {&forward, &backward}) AddProgram(*s);
  const int kBlocks = 50;
  auto add = [](Snapshots &s, int i) {
    uint64_t address = kHeap + 0x40 * i;
    s.BlockOfWords(address, {kHeap + 0x40 * ((i * 7) % kBlocks), uint64_t(i)}, 1, i);
  };
  for (int i = 0; i < kBlocks; i++) add(forward, i);
  for (int i = kBlocks - 1; i >= 0; i--) add(backward, i);
  forward.Finish();
  backward.Finish();
  Written a = Write(forward.ra()), b = Write(backward.ra()), again = Write(forward.ra());
  ASSERT_EQ(a.rc, 0) << a.error;
  EXPECT_EQ(a.bytes, b.bytes);
  EXPECT_EQ(a.bytes, again.bytes);
  WriteAndRead(forward.ra());
}

// A million blocks in one class: a chain of 600,000 (deeper than any recursion could go) and a
// cycle of 400,000. 31-bit hashes of a million objects collide, so uniqueness within the class
// is exercised; Check() verifies it and reachability.
TEST(DartheapWriter, AMillionBlocks) {
  Snapshots s;
  AddProgram(s);
  const uint64_t kChain = 600000, kRing = 400000;
  for (uint64_t i = 0; i < kChain; i++) {
    uint64_t address = kHeap + 16 * i;
    s.BlockOfWords(address, {i + 1 < kChain ? address + 16 : 0, i}, 1, i);
  }
  const uint64_t ring = kHeap + 16 * kChain + 0x1000;
  for (uint64_t i = 0; i < kRing; i++) {
    uint64_t address = ring + 16 * i;
    s.BlockOfWords(address, {i, ring + 16 * ((i + 1) % kRing) + 4}, 1, i);
  }
  s.Finish();
  Graph g = WriteAndRead(s.ra());
  ASSERT_EQ(g.objects.size(), 1 + kChain + kRing);
  EXPECT_EQ(RefsOf(g, 1), (std::vector<uint64_t>{2, 2 + kChain}));
  EXPECT_EQ(g.reference_count, (kChain - 1) + kRing + 2);
  EXPECT_EQ(g.classes.size(), 2u);
  EXPECT_EQ(RefsOf(g, 1 + kChain + kRing), std::vector<uint64_t>{2 + kChain});
}

// ---- errors ----

TEST(DartheapWriter, ContentsOfTheWrongSizeAreAnError) {
  Snapshots s;
  AddProgram(s);
  s.Block(kHeap, 32, 1);
  s.Contents(kHeap, std::vector<uint8_t>(16, 0));  // no Finish(), which would refuse this
  Written w = Write(s.ra());
  EXPECT_EQ(w.rc, -EINVAL);
  EXPECT_NE(w.error.find("16 bytes of contents for a block of 32 bytes"), std::string::npos)
      << w.error;
}

TEST(DartheapWriter, AFailedWriteIsReported) {
  Snapshots s;
  AddProgram(s);
  for (uint64_t i = 0; i < 10000; i++) s.Block(kHeap + 0x100 * i, 16, 1);
  s.Finish();
  FILE *full = fopen("/dev/full", "w");
  ASSERT_NE(full, nullptr);
  char error[256] = "";
  EXPECT_EQ(hd_dartheap_write(s.ra(), nullptr, full, error, sizeof error), -ENOSPC);
  EXPECT_NE(std::string(error).find("writing the dartheap file"), std::string::npos) << error;
  fclose(full);
}

// ---- the reader catches what it must ----

// A dartheap file written by hand, field by field, to break one invariant at a time.
class RawGraph {
 public:
  struct Obj {
    uint64_t class_id;
    uint64_t size;
    std::vector<uint64_t> refs;
  };
  struct Cls {
    std::string name, library, uri;
  };
  std::vector<Cls> classes = {{"Root", "", ""}, {"site", "package:app", "package:app"}};
  // The root references 2, which references 3.
  std::vector<Obj> objects = {{1, 0, {2}}, {2, 16, {3}}, {2, 8, {}}};
  std::vector<uint64_t> hashes = {1, 2, 3};
  bool write_hashes = true;
  int64_t reference_count_delta = 0;

  std::string Bytes() const {
    std::string out = "dartheap";
    Uleb(out, 0);
    Str(out, "test");
    uint64_t shallow = 0, refs = 0;
    for (const Obj &o : objects) shallow += o.size, refs += o.refs.size();
    Uleb(out, shallow);
    Uleb(out, shallow);
    Uleb(out, 0);
    Uleb(out, classes.size());
    for (const Cls &c : classes) {
      Uleb(out, 0);
      Str(out, c.name);
      Str(out, c.library);
      Str(out, c.uri);
      Str(out, "");
      Uleb(out, 0);
    }
    Uleb(out, refs + reference_count_delta);
    Uleb(out, objects.size());
    for (const Obj &o : objects) {
      Uleb(out, o.class_id);
      Uleb(out, o.size);
      Uleb(out, 0);
      Uleb(out, o.refs.size());
      for (uint64_t r : o.refs) Uleb(out, r);
    }
    Uleb(out, 0);
    if (write_hashes) {
      for (uint64_t h : hashes) Uleb(out, h);
    }
    return out;
  }

  static void Uleb(std::string &out, uint64_t v) {
    do {
      uint8_t b = v & 0x7f;
      v >>= 7;
      out.push_back(static_cast<char>(b | (v ? 0x80 : 0)));
    } while (v);
  }
  static void Str(std::string &out, const std::string &s) {
    Uleb(out, s.size());
    out += s;
  }
};

std::string ProblemsOf(const RawGraph &raw) {
  Graph g;
  std::string error;
  if (!dartheap::Parse(raw.Bytes(), &g, &error)) return "parse: " + error;
  return dartheap::CheckReport(g);
}

TEST(DartheapReader, AcceptsAValidGraph) { EXPECT_EQ(ProblemsOf(RawGraph()), ""); }

TEST(DartheapReader, RejectsMalformedFiles) {
  std::string good = RawGraph().Bytes();
  Graph g;
  std::string error;
  ASSERT_TRUE(dartheap::Parse(good, &g, &error)) << error;
  EXPECT_FALSE(dartheap::Parse("dartheaq" + good.substr(8), &g, &error));
  EXPECT_NE(error.find("magic"), std::string::npos) << error;
  EXPECT_FALSE(dartheap::Parse(good.substr(0, good.size() - 1), &g, &error));
  EXPECT_NE(error.find("truncated"), std::string::npos) << error;
  EXPECT_FALSE(dartheap::Parse(good + "x", &g, &error));
  EXPECT_NE(error.find("trailing"), std::string::npos) << error;
  EXPECT_FALSE(dartheap::Parse(good.substr(0, 20), &g, &error));
  EXPECT_NE(error.find("truncated"), std::string::npos) << error;
  std::string long_varint = "dartheap" + std::string(10, '\x80') + '\x01';
  EXPECT_FALSE(dartheap::Parse(long_varint, &g, &error));
  EXPECT_NE(error.find("varint"), std::string::npos) << error;
  // Object 3's data tag is the third-last byte before its reference count (0 refs) and the
  // external property count: ... tag, 0, 0, hashes.
  std::string bad_tag = good;
  size_t tag_at = good.size() - 3 - 3;
  ASSERT_EQ(bad_tag[tag_at], '\0');
  bad_tag[tag_at] = 9;
  EXPECT_FALSE(dartheap::Parse(bad_tag, &g, &error));
  EXPECT_NE(error.find("tag 9"), std::string::npos) << error;
  bad_tag[tag_at] = 2;  // a bool, whose byte is then the reference count 0: valid...
  bad_tag.insert(tag_at + 1, 1, '\x02');  // ...unless the byte is 2
  EXPECT_FALSE(dartheap::Parse(bad_tag, &g, &error));
  EXPECT_NE(error.find("bool"), std::string::npos) << error;
}

void ExpectProblem(const RawGraph &raw, const std::string &what) {
  std::string problems = ProblemsOf(raw);
  EXPECT_NE(problems.find(what), std::string::npos) << "expected \"" << what << "\" in:\n"
                                                    << problems;
}

TEST(DartheapReader, ChecksEveryInvariant) {
  RawGraph raw;
  raw.reference_count_delta = 1;
  ExpectProblem(raw, "header reference count 3 but the objects have 2");

  raw = RawGraph();
  raw.objects[2].refs = {4};
  ExpectProblem(raw, "object 3: reference to object 4 not in 0..3");

  raw = RawGraph();
  raw.objects[2].refs = {1};
  ExpectProblem(raw, "object 3 references the root");

  raw = RawGraph();
  raw.objects[2].class_id = 3;
  ExpectProblem(raw, "object 3: class id 3 not in 1..2");

  raw = RawGraph();
  raw.objects[0].refs = {};
  ExpectProblem(raw, "object 2 is not reachable from the root");

  raw = RawGraph();
  raw.hashes[2] = 0;
  ExpectProblem(raw, "object 3: identity hash code 0");

  raw = RawGraph();
  raw.hashes[2] = 2;
  ExpectProblem(raw, "object 3: identity hash code 2 not unique in class 2");

  raw = RawGraph();
  raw.objects[1].size = uint64_t{1} << 31;
  ExpectProblem(raw, "object 2 shallow size 2147483648 is not below 2^31");

  raw = RawGraph();
  raw.classes[1].uri = "package:a b";
  ExpectProblem(raw, "library URI \"package:a b\" is not a URI");
  raw.classes[1].uri = "1package:x";
  ExpectProblem(raw, "is not a URI");
  raw.classes[1].uri = "package:%2";
  ExpectProblem(raw, "is not a URI");

  raw = RawGraph();
  raw.classes[1].library = "";
  raw.classes[1].uri = "file:///app";
  ExpectProblem(raw, "DevTools' default filter hides");

  raw = RawGraph();
  raw.classes.push_back({"Sentinel", "", ""});
  raw.objects[2].class_id = 3;
  ExpectProblem(raw, "class 3 is named Sentinel with an empty library");

  raw = RawGraph();
  raw.objects[2].class_id = 1;
  ExpectProblem(raw, "class 1 is named Root with an empty library");

  raw = RawGraph();
  raw.write_hashes = false;
  EXPECT_EQ(ProblemsOf(raw), "");  // the hash section is optional as a whole
}

// ---- a real process ----

// The dartheap_child under LD_PRELOAD, stopped after printing its structures until Finish().
struct Child {
  hdtest::Program program;
  pid_t pid;
  std::map<std::string, std::vector<uint64_t>> structures;  // "list", "tree", "ring", "interior"
  explicit Child(const std::string &socket)
      : program({HD_CHILD}, hdtest::InstrumentedEnv(socket)), pid(program.pid) {
    EXPECT_EQ(program.ReadLine(), "ready " + std::to_string(pid));
    for (std::string line; (line = program.ReadLine()) != "" && line != "end";) {
      std::istringstream words(line);
      std::string name, word;
      words >> name;
      while (words >> word) structures[name].push_back(std::stoull(word, nullptr, 16));
    }
  }
  void Finish() {
    if (program.pid <= 0) return;
    program.Send("go");
    int status = program.Finish();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
};

std::unique_ptr<hdtest::Result> TakeLiveSnapshotWithContents(const std::string &socket, pid_t pid) {
  heapdump_client_ProcessSelector selector = hdtest::ByPid(pid);
  return hdtest::TakeLiveSnapshot(socket, &selector, true);
}

TEST(DartheapRealProcess, PointerStructuresOfALiveProcess) {
  std::string dir = hdtest::TempDir("dartheap-test");
  hdtest::Collector collector(dir);
  collector.Start();
  Child child(collector.socket);
  const auto &list = child.structures["list"], &tree = child.structures["tree"],
             &ring = child.structures["ring"], &interior = child.structures["interior"];
  ASSERT_EQ(list.size(), 4u);
  ASSERT_EQ(tree.size(), 7u);
  ASSERT_EQ(ring.size(), 3u);
  ASSERT_EQ(interior.size(), 2u);

  auto first = TakeLiveSnapshotWithContents(collector.socket, child.pid);
  ASSERT_EQ(first->status, HD_OK) << first->ra.error;
  ASSERT_EQ(first->error, 0u);
  ASSERT_EQ(first->ra.snapshot_count, 1u);
  hd_symbolizer *symbolizer = nullptr;
  ASSERT_EQ(hd_symbolizer_create(nullptr, &symbolizer), 0);
  hd_dartheap_options options = {};
  options.symbolizer = symbolizer;
  Graph g = WriteAndRead(&first->ra, &options);
  ASSERT_FALSE(::testing::Test::HasFailure());
  auto id = IdsByAddress(&first->ra, 0);
  for (const auto &[name, addresses] : child.structures) {
    for (uint64_t a : addresses) {
      ASSERT_EQ(id.count(a), 1u) << name << " block 0x" << std::hex << a;
    }
  }

  for (int i = 0; i < 3; i++) {
    EXPECT_EQ(RefsOf(g, id[list[i]]), std::vector<uint64_t>{id[list[i + 1]]});
  }
  EXPECT_TRUE(RefsOf(g, id[list[3]]).empty());
  for (int i = 0; i < 3; i++) {
    EXPECT_EQ(RefsOf(g, id[tree[i]]),
              (std::vector<uint64_t>{id[tree[2 * i + 1]], id[tree[2 * i + 2]]}));
  }
  for (int i = 3; i < 7; i++) EXPECT_TRUE(RefsOf(g, id[tree[i]]).empty());
  for (int i = 0; i < 3; i++) {
    EXPECT_EQ(RefsOf(g, id[ring[i]]), std::vector<uint64_t>{id[ring[(i + 1) % 3]]});
  }
  EXPECT_EQ(RefsOf(g, id[interior[0]]), std::vector<uint64_t>{id[interior[1]]});

  // Only globals point at the structures' first blocks, so the root does; of the ring, exactly
  // its lowest address.
  std::vector<uint64_t> root = RefsOf(g, 1);
  auto root_refs = [&root](uint64_t object) {
    return std::count(root.begin(), root.end(), object);
  };
  EXPECT_EQ(root_refs(id[list[0]]), 1);
  EXPECT_EQ(root_refs(id[tree[0]]), 1);
  EXPECT_EQ(root_refs(id[interior[0]]), 1);
  EXPECT_EQ(root_refs(id[*std::min_element(ring.begin(), ring.end())]), 1);
  EXPECT_EQ(root_refs(id[ring[0]]) + root_refs(id[ring[1]]) + root_refs(id[ring[2]]), 1);
  EXPECT_EQ(root_refs(id[interior[1]]), 0);

  // Classes are the allocating functions, in the executable's library.
  const std::pair<const std::vector<uint64_t> *, const char *> sites[] = {
      {&list, "build_list"},
      {&tree, "build_tree"},
      {&ring, "build_ring"},
      {&interior, "build_interior_pointer"}};
  for (const auto &[blocks, function] : sites) {
    for (uint64_t a : *blocks) {
      EXPECT_EQ(g.class_of(id[a]).name, function);
      EXPECT_EQ(g.class_of(id[a]).library_name, "package:dartheap_child");
    }
  }

  // A second snapshot of the same process: the same blocks keep their identity hashes. Without
  // a symbolizer the sites are module offsets, in the same library.
  auto second = TakeLiveSnapshotWithContents(collector.socket, child.pid);
  ASSERT_EQ(second->status, HD_OK) << second->ra.error;
  Graph h = WriteAndRead(&second->ra);
  auto id2 = IdsByAddress(&second->ra, 0);
  for (const auto &[name, addresses] : child.structures) {
    for (uint64_t a : addresses) {
      ASSERT_EQ(id2.count(a), 1u);
      EXPECT_EQ(g.identity_hash(id[a]), h.identity_hash(id2[a])) << name;
      EXPECT_EQ(h.class_of(id2[a]).name.rfind("dartheap_child+0x", 0), 0u)
          << h.class_of(id2[a]).name;
      EXPECT_EQ(h.class_of(id2[a]).library_name, "package:dartheap_child");
    }
  }
  hd_symbolizer_destroy(symbolizer);
  child.Finish();
}

}  // namespace
