// Integration tests: real programs run under LD_PRELOAD=libheapdump.so; their tables are read
// through /proc/<pid>/fd with the collector's reader while the program waits on a pipe.
#include <dirent.h>
#include <elf.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "heapdump/contract/names.h"
#include "heapdump/contract/shm_layout.h"
#include "process.h"
#include "table_reader.h"

extern char **environ;

namespace {

// The environment of a test program; HEAPDUMP_SOCKET names no collector unless `extra` sets
// it, so a collector running at the default path cannot change a result.
std::vector<std::string> Env(bool preload, const std::vector<std::string> &extra) {
  std::vector<std::string> env;
  for (char **e = environ; *e; e++)
    if (strncmp(*e, "LD_PRELOAD=", 11) && strncmp(*e, "HEAPDUMP_", 9)) env.push_back(*e);
  if (preload) env.push_back(std::string("LD_PRELOAD=") + HD_PRELOAD_LIB);
  bool socket_set = false;
  for (auto &x : extra) socket_set |= x.rfind("HEAPDUMP_SOCKET=", 0) == 0;
  if (!socket_set) env.push_back("HEAPDUMP_SOCKET=/nonexistent/heapdump-test.sock");
  for (auto &x : extra) env.push_back(x);
  return env;
}

// What a program printed and how it ended.
struct Ran {
  int status = -1;
  std::string out;
};

// Runs argv with exactly env to its end, with nothing on its stdin.
Ran RunToEnd(const std::vector<std::string> &argv, const std::vector<std::string> &env) {
  hdtest::Program program(hdtest::Isolated{}, argv, env);
  Ran ran;
  ran.status = program.Finish(&ran.out);
  return ran;
}

int OpenMemfd(pid_t pid, const char *name) {
  std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR *d = opendir(dir.c_str());
  if (!d) return -1;
  int fd = -1;
  while (struct dirent *e = readdir(d)) {
    std::string path = dir + "/" + e->d_name;
    char link[256];
    ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
    if (n <= 0) continue;
    link[n] = 0;
    if (strstr(link, name)) fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  }
  closedir(d);
  return fd;
}

struct Tables {
  std::vector<hd_live_block> blocks;
  hd_table_stats stats{};  // read right after the snapshot, while the child waits
  // Every trace's counters, read then too (the child's exit frees blocks and moves them).
  std::map<uint32_t, hd_trace_counters> counters;
  hd_res_reader *res = nullptr;
  ~Tables() { hd_res_reader_close(res); }
  int CountSize(uint64_t size) const {
    int c = 0;
    for (auto &b : blocks) c += b.size == size;
    return c;
  }
  const hd_live_block *FindSize(uint64_t size) const {
    for (auto &b : blocks)
      if (b.size == size) return &b;
    return nullptr;
  }
  std::vector<hd_res_entry> Entries(int type) const {
    std::vector<hd_res_entry> v;
    uint64_t cursor = 0;
    hd_res_entry e;
    hd_read_status st;
    while ((st = hd_res_reader_next(res, &cursor, &e)) == HD_READ_OK)
      if (e.type == type) v.push_back(e);
    EXPECT_EQ(st, HD_READ_END);
    return v;
  }
  // Name of the region containing pc ("" if none).
  std::string RegionOf(uint64_t pc) const {
    for (auto &e : Entries(HD_ENTRY_REGION))
      if (pc >= e.u.region.address && pc < e.u.region.address + e.u.region.size)
        return e.u.region.name;
    return "";
  }
};

void ReadTables(pid_t pid, Tables *t) {
  int afd = OpenMemfd(pid, "memfd:" HD_MEMFD_ALLOCATIONS);
  int rfd = OpenMemfd(pid, "memfd:" HD_MEMFD_RESOURCES);
  ASSERT_GE(afd, 0);
  ASSERT_GE(rfd, 0);
  hd_alloc_reader *a;
  ASSERT_EQ(hd_alloc_reader_open(afd, &a), HD_READ_OK);
  hd_live_block *b;
  size_t n;
  ASSERT_EQ(hd_alloc_reader_snapshot(a, &b, &n), HD_READ_OK);
  t->blocks.assign(b, b + n);
  free(b);
  hd_alloc_reader_close(a);
  ASSERT_EQ(hd_res_reader_open(rfd, &t->res), HD_READ_OK);
  ASSERT_EQ(hd_res_reader_stats(t->res, &t->stats), HD_READ_OK);
  uint64_t cursor = 0;
  hd_res_entry e;
  while (hd_res_reader_next(t->res, &cursor, &e) == HD_READ_OK) {
    if (e.type != HD_ENTRY_STACK) continue;
    uint64_t frames[HD_MAX_FRAMES];
    size_t count;
    ASSERT_EQ(hd_res_reader_stack(t->res, e.key, frames, HD_MAX_FRAMES, &count, &t->counters[e.key],
                                  nullptr),
              HD_READ_OK);
  }
  close(afd);
  close(rfd);
}

struct Config {
  const char *name;
  std::vector<std::string> env;
};

class Preload : public ::testing::TestWithParam<Config> {
 protected:
  // Runs hd_child <mode...>, reads its tables at "ready", then lets it exit 0.
  void RunChild(const std::vector<std::string> &args, Tables *t,
                const std::vector<std::string> &extra_env = {}) {
    std::vector<std::string> argv = {HD_CHILD};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<std::string> env = GetParam().env;
    env.insert(env.end(), extra_env.begin(), extra_env.end());
    hdtest::Program child(hdtest::Isolated{}, argv, Env(true, env));
    std::string out = child.ReadThrough("ready");
    const bool ready = out.size() >= 6 && out.compare(out.size() - 6, 6, "ready\n") == 0;
    if (ready) ReadTables(child.pid, t);
    int st = child.Finish(&out);
    ASSERT_TRUE(ready) << "child output: " << out;
    ASSERT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "status " << st << " out: " << out;
    last_output = out;
  }
  std::string last_output;  // the child's stdout

  // Sampling at 4 KiB on this configuration's backend: glibc, or jemalloc asked for by name
  // (sampled from the start, the library keeps glibc unless told).
  std::vector<std::string> SampledEnv() const {
    std::vector<std::string> env = {"HEAPDUMP_SAMPLE_BYTES=4096"};
    if (std::string(GetParam().name).rfind("jemalloc", 0) == 0)
      env.push_back("HEAPDUMP_ALLOCATOR=jemalloc");
    return env;
  }

  // The signals scenario's last line: signals handled, and the handler's ring blocks live (-1
  // if the line is missing, which fails the test).
  struct SignalsLine {
    unsigned handled = 0, failed = 0;
    int ring = -1;
    // Where the signals landed: the library's code, libc's on the library's behalf (and how
    // many of those the handler's malloc failed), libc's on the program's (skipped by a
    // sampled run's handler).
    unsigned in_library = 0, in_libc_for_library = 0, failed_in_libc_for_library = 0,
             skipped_in_libc = 0;
  };
  SignalsLine ReadSignalsLine() const {
    SignalsLine line;
    EXPECT_EQ(
        sscanf(last_output.c_str(),
               "handled %u failed %u ring %d in-library %u in-libc-for-library %u "
               "(failed %u) skipped-in-libc %u",
               &line.handled, &line.failed, &line.ring, &line.in_library, &line.in_libc_for_library,
               &line.failed_in_libc_for_library, &line.skipped_in_libc),
        7)
        << last_output;
    return line;
  }
};

// The "threads" workers' cumulative counters: the 8 share one trace, which allocated 8 x 20000
// blocks.
static void ExpectWorkersTraceCounts(const Tables &t) {
  const hd_live_block *b = t.FindSize(7700);
  ASSERT_NE(b, nullptr);
  uint64_t frames[64];
  hd_trace_counters counters{};
  size_t n;
  ASSERT_EQ(hd_res_reader_stack(t.res, b->stack_key, frames, 64, &n, &counters, nullptr),
            HD_READ_OK);
  EXPECT_EQ(counters.allocated_blocks, 8u * 20000);
  EXPECT_EQ(counters.allocated_bytes, 20000u * (8 * 7700 + 28));
}

TEST_P(Preload, EightThreadsExactCountsStacksAndNames) {
  Tables t;
  RunChild({"threads"}, &t);
  std::map<uint32_t, std::string> names;
  for (auto &e : t.Entries(HD_ENTRY_THREAD)) names[e.key] = e.u.thread.name;
  for (int th = 0; th < 8; th++) {
    EXPECT_EQ(t.CountSize(7700 + th), 250) << "thread " << th;
    const hd_live_block *b = t.FindSize(7700 + th);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(names[b->thread_key], "worker-" + std::to_string(th));
    uint64_t frames[64];
    size_t n;
    ASSERT_EQ(hd_res_reader_stack(t.res, b->stack_key, frames, 64, &n, nullptr, nullptr),
              HD_READ_OK);
    ASSERT_GE(n, 1u);
    // The innermost frame is the caller of malloc, in the child's own executable.
    EXPECT_NE(t.RegionOf(frames[0]).find("hd_child"), std::string::npos)
        << "frame0 in " << t.RegionOf(frames[0]);
  }
  const hd_table_stats &s = t.stats;
  EXPECT_EQ(s.live_blocks, t.blocks.size());
  EXPECT_GE(s.blocks_allocated, 8u * 20000);
  EXPECT_EQ(s.dropped_allocations, 0u);
  ExpectWorkersTraceCounts(t);
}

// The same eight workers, alive while the tables are read: the trace's counts are its record's
// plus what each worker holds in its own counters record, and add up exactly.
TEST_P(Preload, CountsThreadsStillHoldAddUpExactly) {
  Tables t;
  RunChild({"threads-alive"}, &t);
  for (int th = 0; th < 8; th++) EXPECT_EQ(t.CountSize(7700 + th), 250) << "thread " << th;
  ExpectWorkersTraceCounts(t);
}

// Each thread that allocates records where its stack and thread pointer are, for the collector's
// leak-check roots: the stack around a local variable of the thread's, the thread pointer the
// thread itself sees.
TEST_P(Preload, ThreadsRecordTheirStacksAndThreadPointers) {
  Tables t;
  RunChild({"roots"}, &t);
  std::map<uint32_t, hd_thread_roots> recorded;
  for (auto &e : t.Entries(HD_ENTRY_THREAD_ROOTS))
    recorded[e.u.thread_roots.tid] = e.u.thread_roots;
  int threads = 0;
  std::istringstream out(last_output);
  for (std::string line; std::getline(out, line);) {
    std::istringstream in(line);
    std::string word, who;
    uint32_t tid;
    uint64_t tp, local;
    if (!(in >> word >> who >> tid >> std::hex >> tp >> local) || word != "roots") continue;
    threads++;
    ASSERT_EQ(recorded.count(tid), 1u) << who;
    const hd_thread_roots &r = recorded[tid];
    EXPECT_EQ(r.thread_pointer, tp) << who;
    EXPECT_LE(r.stack_lo, local) << who;
    EXPECT_GT(r.stack_hi, local) << who;
  }
  EXPECT_EQ(threads, 2) << last_output;
}

TEST_P(Preload, CxxNewDeleteVariantsReachTheInterposer) {
  Tables t;
  RunChild({"cxx"}, &t);
  EXPECT_EQ(t.CountSize(4441), 1);
  // libstdc++'s aligned new calls aligned_alloc with the size rounded up to the alignment.
  ASSERT_EQ(t.CountSize(4480), 1);
  EXPECT_EQ(t.FindSize(4480)->address % 64, 0u);
  EXPECT_EQ(t.CountSize(4443), 1);
  EXPECT_EQ(t.CountSize(4444), 1);
  EXPECT_EQ(t.CountSize(4445), 0);
  EXPECT_EQ(t.CountSize(4446), 0);
}

TEST_P(Preload, ReallocKeepsOneRecord) {
  Tables t;
  RunChild({"realloc"}, &t);
  EXPECT_EQ(t.CountSize(5001), 0);
  EXPECT_EQ(t.CountSize(5002), 1);
  EXPECT_EQ(t.CountSize(5003), 1);
  EXPECT_EQ(t.CountSize(5004), 0);
  EXPECT_EQ(t.CountSize(1 << 20), 1);
  EXPECT_EQ(t.CountSize(300000), 0);
  EXPECT_EQ(t.CountSize(5005), 1);
}

TEST_P(Preload, EdgeCasesAndAlignedEntryPoints) {
  Tables t;
  RunChild({"edge"}, &t);
  EXPECT_GE(t.CountSize(0), 1);
  ASSERT_EQ(t.CountSize(6001), 1);
  EXPECT_EQ(t.FindSize(6001)->address % 64, 0u);
  ASSERT_EQ(t.CountSize(6002), 1);
  EXPECT_EQ(t.FindSize(6002)->address % 4096, 0u);
  EXPECT_EQ(t.CountSize(6003), 1);
  EXPECT_EQ(t.CountSize(6004), 1);
  EXPECT_EQ(t.CountSize(8192), 1);  // pvalloc(6005) rounded to pages
  EXPECT_EQ(t.CountSize(6006), 1);
  EXPECT_EQ(t.CountSize(6000), 0);                                // all freed
  for (auto &b : t.blocks) EXPECT_LT(b.size, (uint64_t)1 << 40);  // failed requests unrecorded
}

// Sampled at 4 KiB: on glibc (the system configurations, and the default one sampled) the
// blocks sampling leaves out carry no tag, on jemalloc (asked for by name) every block does.
// Either way, with each unwinder, blocks of every entry point, reallocated, written over all of
// their usable size and freed by their own thread or another leave no record behind them and
// count no write past a block's end; the kept blocks, which the rate always samples, are all
// recorded.
TEST_P(Preload, SampledRecordingLeavesNoRecordBehind) {
  Tables t;
  RunChild({"sampled-churn"}, &t, SampledEnv());
  EXPECT_NE(last_output.find("churned\n"), std::string::npos) << last_output;
  EXPECT_EQ(t.CountSize(100000), 500);
  std::map<uint32_t, std::string> names;
  for (auto &e : t.Entries(HD_ENTRY_THREAD)) names[e.key] = e.u.thread.name;
  size_t churned = 0;
  for (const hd_live_block &b : t.blocks) churned += names[b.thread_key].rfind("churn-", 0) == 0;
  EXPECT_EQ(churned, 0u) << "records of freed blocks left behind";
  EXPECT_EQ(t.stats.writes_past_block_end, 0u);
  EXPECT_EQ(t.stats.sample_bytes, 4096u);
  // 120,000 blocks of 16-4000 bytes were allocated besides the kept ones (reallocations count
  // as allocations too): the estimate is of that order.
  EXPECT_GT(t.stats.blocks_allocated, 60000u);
  EXPECT_LT(t.stats.blocks_allocated, 400000u);
}

TEST_P(Preload, ForkWithBusyThreadsGivesChildItsOwnTables) {
  Tables t;
  RunChild({"fork"}, &t);
  EXPECT_EQ(t.CountSize(8888), 1);  // children freed their copies, not ours
  EXPECT_EQ(t.CountSize(9999), 0);
}

TEST_P(Preload, DlopenDlcloseRegionsAndAllocations) {
  Tables t;
  RunChild({"dlopen", HD_TEST_LIB}, &t);
  EXPECT_EQ(t.CountSize(7121), 1);  // from the module's constructor
  ASSERT_EQ(t.CountSize(7123), 1);
  bool region = false;
  for (auto &e : t.Entries(HD_ENTRY_REGION)) {
    if (strstr(e.u.region.name, "libhd_testlib.so")) {
      region = true;
      EXPECT_GT(e.u.region.build_id_len, 0u);
    }
  }
  EXPECT_TRUE(region) << "unloaded module's region must stay recorded";
}

// Unwinding opens no descriptor, not even briefly: libunwind's validation pipe and its reading of
// a module without .eh_frame_hdr would take numbers a program may be reusing. Traces through
// that module still reach the program (by its frame pointers).
TEST_P(Preload, TheUnwinderOpensNoDescriptors) {
  Tables t;
  RunChild({"unwinder-opens", HD_TEST_LIB_WITHOUT_EH_FRAME_HDR}, &t);
  EXPECT_NE(last_output.find("opened 0 pipes 0\n"), std::string::npos) << last_output;
  ASSERT_EQ(t.CountSize(7124), 20);
  uint64_t frames[64];
  size_t n;
  ASSERT_EQ(
      hd_res_reader_stack(t.res, t.FindSize(7124)->stack_key, frames, 64, &n, nullptr, nullptr),
      HD_READ_OK);
  std::string trace;
  for (size_t i = 0; i < n; i++) trace += t.RegionOf(frames[i]) + "\n";
  const size_t in_module = trace.find("libhd_testlib_nohdr.so\n");
  ASSERT_NE(in_module, std::string::npos) << trace;
  EXPECT_NE(trace.find("hd_child\n", in_module), std::string::npos) << trace;
  // A module without .eh_frame_hdr is beyond our unwinder: those stacks go to libunwind, and
  // the process statistics count them.
  const auto &env = GetParam().env;
  const bool ours = std::none_of(env.begin(), env.end(), [](const std::string &e) {
    return e.rfind("HEAPDUMP_UNWIND=", 0) == 0;  // the default is ours
  });
  if (ours) {
    EXPECT_GE(t.stats.stacks_beyond_cfi, 20u);
  } else {
    EXPECT_EQ(t.stats.stacks_beyond_cfi, 0u);
  }
}

// Where a module file holds a section: its file offset and size (0, 0 if it has none).
std::pair<size_t, size_t> SectionOf(const std::vector<uint8_t> &elf, const char *name) {
  Elf64_Ehdr eh;
  memcpy(&eh, elf.data(), sizeof eh);
  std::vector<Elf64_Shdr> sections(eh.e_shnum);
  memcpy(sections.data(), elf.data() + eh.e_shoff, eh.e_shnum * sizeof(Elf64_Shdr));
  const char *names =
      reinterpret_cast<const char *>(elf.data()) + sections[eh.e_shstrndx].sh_offset;
  for (const Elf64_Shdr &s : sections) {
    if (strcmp(names + s.sh_name, name) == 0) return {s.sh_offset, s.sh_size};
  }
  return {0, 0};
}

// A copy of the test module in dir, its bytes edited by corrupt(bytes, .eh_frame_hdr's offset,
// .eh_frame's offset and size).
std::string CorruptModule(
    const std::string &dir, const std::string &name,
    const std::function<void(std::vector<uint8_t> *, size_t, size_t, size_t)> &corrupt) {
  const std::string text = hdtest::ReadFile(HD_TEST_LIB);
  std::vector<uint8_t> bytes(text.begin(), text.end());
  const auto [hdr, hdr_size] = SectionOf(bytes, ".eh_frame_hdr");
  const auto [eh, eh_size] = SectionOf(bytes, ".eh_frame");
  EXPECT_GT(hdr_size, 12u);
  EXPECT_GT(eh_size, 16u);
  corrupt(&bytes, hdr, eh, eh_size);
  const std::string path = dir + "/" + name + ".so";
  hdtest::WriteFile(path, std::string(bytes.begin(), bytes.end()));
  return path;
}

void Put32(std::vector<uint8_t> *bytes, size_t at, uint32_t value) {
  memcpy(bytes->data() + at, &value, 4);
}

// A dlopen'ed module whose unwind tables are inconsistent (a search-table entry pointing 1 GiB
// away, an FDE whose CIE pointer leaves the module, a table entry that disagrees with its FDE)
// used to crash the program under our unwinder and under libunwind. Each is refused when the
// module is loaded and counted (unwind_tables_refused); its frames are stepped by frame pointers,
// so the traces still reach the program; libunwind is not shown it. Then random corruptions of
// its tables: the program runs to its end and every allocation is recorded.
TEST_P(Preload, AModuleWithCorruptUnwindTablesIsRefusedNotFollowed) {
  const std::string dir = hdtest::TempDir("corrupt-module");
  hdtest::RemoveWhenPassed cleanup{dir};
  const auto &env = GetParam().env;
  const bool frame_pointers = std::find(env.begin(), env.end(), "HEAPDUMP_UNWIND=fp") != env.end();
  auto first_fde = [](const std::vector<uint8_t> &b, size_t hdr) {
    int32_t to_fde;
    memcpy(&to_fde, b.data() + hdr + 16, 4);  // the first entry's FDE, relative to the header
    return hdr + static_cast<size_t>(static_cast<int64_t>(to_fde));
  };
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"entry-far", CorruptModule(dir, "entry-far",
                                  [](std::vector<uint8_t> *b, size_t hdr, size_t, size_t) {
                                    Put32(b, hdr + 16, 0x40000000);
                                  })},
      {"cie-far", CorruptModule(dir, "cie-far",
                                [&](std::vector<uint8_t> *b, size_t hdr, size_t, size_t) {
                                  Put32(b, first_fde(*b, hdr) + 4, 0x7ffffff0);
                                })},
      {"entry-disagrees", CorruptModule(dir, "entry-disagrees",
                                        [](std::vector<uint8_t> *b, size_t hdr, size_t, size_t) {
                                          (*b)[hdr + 12] ^=
                                              0x40;  // the first entry's function moved
                                        })},
  };
  for (const auto &[kind, path] : refused) {
    SCOPED_TRACE(kind);
    Tables t;
    RunChild({"corrupt-module", path}, &t);
    ASSERT_EQ(t.CountSize(7125), 20);
    EXPECT_EQ(t.stats.unwind_tables_refused, frame_pointers ? 0u : 1u);
    uint64_t frames[64];
    size_t n;
    ASSERT_EQ(
        hd_res_reader_stack(t.res, t.FindSize(7125)->stack_key, frames, 64, &n, nullptr, nullptr),
        HD_READ_OK);
    std::string trace;
    for (size_t i = 0; i < n; i++) trace += t.RegionOf(frames[i]) + "\n";
    const size_t in_module = trace.find(kind + ".so\n");
    ASSERT_NE(in_module, std::string::npos) << trace;
    const bool libunwind =
        std::find(env.begin(), env.end(), "HEAPDUMP_UNWIND=libunwind") != env.end();
    if (!libunwind) {  // libunwind, shown no tables for the module, ends the trace there
      EXPECT_NE(trace.find("hd_child\n", in_module), std::string::npos) << trace;
    }
  }
  std::mt19937 rng(20261129);
  for (int i = 0; i < 24; i++) {
    SCOPED_TRACE("random corruption " + std::to_string(i));
    const std::string path =
        CorruptModule(dir, "random-" + std::to_string(i),
                      [&](std::vector<uint8_t> *b, size_t hdr, size_t eh, size_t eh_size) {
                        // Four bytes of the search table's entries, four of .eh_frame.
                        for (int k = 0; k < 4; k++)
                          (*b)[hdr + 12 + rng() % 16] = static_cast<uint8_t>(rng());
                        for (int k = 0; k < 4; k++)
                          (*b)[eh + rng() % eh_size] = static_cast<uint8_t>(rng());
                      });
    Tables t;
    RunChild({"corrupt-module", path}, &t);
    EXPECT_EQ(t.CountSize(7125), 20);
  }
}

// A program that fills what malloc_usable_size gives it overflows nothing; one that writes past
// that overwrites the bytes kept after the block, and the statistics count it. Four bytes past,
// its free still finds and erases the record; eight bytes past, the record is not found (and not
// searched for: a free costs the same whatever the program wrote), so the block stays recorded.
TEST_P(Preload, WritesPastABlockAreCountedAndItsRecordStillErased) {
  Tables t;
  RunChild({"overflow"}, &t);
  EXPECT_EQ(t.stats.writes_past_block_end, 2u);
  EXPECT_EQ(t.CountSize(24), 0);
  EXPECT_EQ(t.CountSize(40), 1);
  EXPECT_EQ(t.CountSize(7131), 0);
  EXPECT_EQ(t.CountSize(7132), 1);
}

// A block freed twice ends the program as glibc ends one, with its message and SIGABRT, before
// the allocator could hand the block out twice; by free, and by realloc of the freed block.
TEST_P(Preload, ADoubleFreeEndsTheProgramAsGlibcDoes) {
  const std::string dir = hdtest::TempDir("double-free");
  hdtest::RemoveWhenPassed cleanup{dir};
  for (const auto &[mode, says] : {std::pair<const char *, const char *>{"double-free", "free()"},
                                   {"realloc-freed", "realloc()"}}) {
    hdtest::ShellOutput run =
        hdtest::RunShell(std::string(HD_CHILD) + " " + mode + " 2>&1 || echo \"status $?\"", dir,
                         Env(true, GetParam().env));
    EXPECT_NE(run.out.find("status 134"), std::string::npos) << mode << ": " << run.out;
    EXPECT_NE(run.out.find(std::string(says) + ": double free detected"), std::string::npos)
        << mode << ": " << run.out;
  }
}

// A program calling jemalloc's API itself, as folly does when it finds jemalloc serving malloc,
// gets recorded blocks and valid sized frees, on either backend; the rest of the jemalloc inside
// the library (mallctl) is not the program's.
TEST_P(Preload, JemallocsOwnApiIsRecordedLikeMalloc) {
  Tables t;
  RunChild({"jemalloc-api"}, &t);
  EXPECT_NE(last_output.find("mallctl in the program's scope: no\n"), std::string::npos)
      << last_output;
  const std::pair<uint64_t, int> kept[] = {{5000, 1}, {5001, 1}, {4093, 0}, {5003, 0}, {50030, 1},
                                           {5004, 0}, {5005, 1}, {5006, 0}, {5007, 0}};
  for (const auto &[size, count] : kept) EXPECT_EQ(t.CountSize(size), count) << size << " bytes";
  EXPECT_EQ(t.stats.writes_past_block_end, 0u);
}

// A fork while another thread holds the unwinder's lock leaves the child able to unwind: libunwind
// keeps a process-wide lock that a fork child would otherwise wait on forever (the child was seen
// hanging so under load in ForkWithBusyThreadsGivesChildItsOwnTables).
TEST_P(Preload, AForkChildNeverWaitsForTheUnwinderLockOfAnotherThread) {
  Tables t;
  RunChild({"fork-unwinder-locked"}, &t);
  if (last_output.find("skipped") != std::string::npos)
    GTEST_SKIP() << "libunwind is not 1.6: its lock cannot be found to hold";
  EXPECT_NE(last_output.find("child allocated\n"), std::string::npos) << last_output;
}

TEST_P(Preload, VforkAndPosixSpawnChildrenGetTheirOwnTables) {
  Tables t;
  RunChild({"spawn", "1", HD_STATIC_PROBE}, &t);
  EXPECT_EQ(t.CountSize(8888), 1);
  EXPECT_EQ(t.CountSize(12121), 0);  // the probes' blocks are in their own tables
}

TEST_P(Preload, FollowChildrenZeroExecsUninstrumentedChildren) {
  Tables t;
  RunChild({"spawn", "0", HD_STATIC_PROBE}, &t, {"HEAPDUMP_FOLLOW_CHILDREN=0"});
  EXPECT_EQ(t.CountSize(8888), 1);  // the parent itself is still recorded
}

TEST_P(Preload, SignalHandlerAllocatingDuringAllocations) {
  Tables t;
  RunChild({"signals"}, &t);
  const SignalsLine line = ReadSignalsLine();
  EXPECT_GE(line.handled, 2000u);
  EXPECT_EQ(t.CountSize(3001), line.ring);
  EXPECT_EQ(t.CountSize(3002), 100);
  EXPECT_EQ(t.CountSize(3003), 0);
  EXPECT_EQ(t.stats.live_blocks, t.blocks.size());
  EXPECT_EQ(t.stats.dropped_allocations, 0u);
}

// Sampled at 4 KiB. On glibc the program's call for a block sampling leaves out is glibc's
// alone: a handler that interrupts glibc's code there enters it again, as without the library,
// so the handler skips the signals that land in libc on the program's behalf (the first frame
// outside libc not the library's). Those that land in the library's code (the countdown, the
// recording of sampled blocks, and on jemalloc, asked for by name, the allocator too) or in
// glibc's on its behalf (a call it marks) it must survive: its allocation is served or fails
// (ENOMEM), its free is done or waits for the thread's next hook. The program ends normally,
// and no freed block is left recorded.
TEST_P(Preload, SignalHandlerAllocatingDuringSampledAllocations) {
  Tables t;
  RunChild({"signals-sampled"}, &t, SampledEnv());
  const SignalsLine line = ReadSignalsLine();
  EXPECT_GE(line.handled, 2000u);
  EXPECT_GE(line.in_library, 20u) << "too few signals landed in the library to test it";
  // On glibc, the handler's malloc fails in the calls the library marks around glibc's:
  // enough of them to show the handler met those (and took them for the library's).
  if (std::string(GetParam().name).rfind("system", 0) == 0) {
    EXPECT_GE(line.failed_in_libc_for_library, 10u)
        << "too few signals landed in glibc's marked calls";
  }
  EXPECT_LE(t.CountSize(3001), line.ring);
  EXPECT_LE(t.CountSize(3002), 100);
  EXPECT_EQ(t.CountSize(3003), 0);
  EXPECT_EQ(t.stats.writes_past_block_end, 0u);
}

// Timestamps are CLOCK_MONOTONIC: to the nanosecond with HEAPDUMP_CLOCK=precise, and by
// default read from the coarse clock, which lags by at most a kernel tick (<= 10 ms at HZ=100).
TEST_P(Preload, TimestampsAreMonotonicClockAtTheChosenResolution) {
  for (bool precise : {false, true}) {
    Tables t;
    std::vector<std::string> env;
    if (precise) env.push_back("HEAPDUMP_CLOCK=precise");
    RunChild({"clock"}, &t, env);
    unsigned long long before = 0, after = 0;
    size_t at = last_output.find("clock ");
    ASSERT_NE(at, std::string::npos) << last_output;
    ASSERT_EQ(sscanf(last_output.c_str() + at, "clock %llu %llu", &before, &after), 2);
    const hd_live_block *b = t.FindSize(7777);
    ASSERT_NE(b, nullptr);
    uint64_t slack = precise ? 0 : 10000000;
    EXPECT_GE(b->timestamp + slack, before) << (precise ? "precise" : "coarse");
    EXPECT_LE(b->timestamp, after) << (precise ? "precise" : "coarse");
  }
}

// 2048 distinct call paths, each allocating twice far apart: the two blocks of a path share
// a trace, no two paths do, and each trace counts exactly its two allocations.
TEST_P(Preload, EachCallPathHasItsOwnTrace) {
  Tables t;
  RunChild({"paths"}, &t);
  std::map<uint64_t, std::vector<uint32_t>> keys_by_size;
  for (auto &b : t.blocks)
    if (b.size >= 11000 && b.size < 11000 + 2048) keys_by_size[b.size].push_back(b.stack_key);
  ASSERT_EQ(keys_by_size.size(), 2048u);
  std::map<uint32_t, uint64_t> size_by_key;
  for (auto &[size, keys] : keys_by_size) {
    ASSERT_EQ(keys.size(), 2u) << size;
    EXPECT_EQ(keys[0], keys[1]) << "path " << size - 11000;
    EXPECT_NE(keys[0], 0u);
    auto [it, fresh] = size_by_key.emplace(keys[0], size);
    EXPECT_TRUE(fresh) << "paths " << it->second - 11000 << " and " << size - 11000
                       << " share a trace";
    uint64_t frames[64];
    hd_trace_counters counters{};
    size_t n;
    ASSERT_EQ(hd_res_reader_stack(t.res, keys[0], frames, 64, &n, &counters, nullptr), HD_READ_OK);
    EXPECT_GE(n, 12u);  // malloc's caller and 11 levels of the path
    EXPECT_EQ(counters.allocated_blocks, 2u);
    EXPECT_EQ(counters.allocated_bytes, 2 * size);
  }
}

// One site reached from three callers in turn (child.cc, scenario_callers): each caller's trace
// counts exactly its own allocations, reused traces included.
TEST_P(Preload, EachCallerOfOneSiteCountsItsOwnAllocations) {
  Tables t;
  RunChild({"callers"}, &t);
  constexpr uint64_t kRounds = 20000, kSize = 4321;
  size_t traces = 0;
  uint64_t cursor = 0;
  hd_res_entry e;
  while (hd_res_reader_next(t.res, &cursor, &e) == HD_READ_OK) {
    if (e.type != HD_ENTRY_STACK) continue;
    uint64_t frames[64];
    hd_trace_counters counters{};
    size_t n;
    ASSERT_EQ(hd_res_reader_stack(t.res, e.key, frames, 64, &n, &counters, nullptr), HD_READ_OK);
    const uint64_t blocks = counters.allocated_blocks, bytes = counters.allocated_bytes;
    if (bytes % kSize != 0 || blocks == 0 || bytes / blocks != kSize) continue;
    traces++;
    EXPECT_EQ(blocks, kRounds) << "trace " << e.key;
  }
  EXPECT_EQ(traces, 3u);
}

// Temporary allocations as heaptrack counts them, per thread (child.cc, scenario_temporary):
// blocks freed before their thread's next allocation or free, a realloc counting as a free then
// an allocation, and never a block another thread frees.
TEST_P(Preload, TemporaryAllocationsAreFreedBeforeTheirThreadAllocatesOrFreesAgain) {
  Tables t;
  RunChild({"temporary"}, &t);
  std::map<uint64_t, hd_trace_counters> by_size;
  uint64_t cursor = 0;
  hd_res_entry e;
  while (hd_res_reader_next(t.res, &cursor, &e) == HD_READ_OK) {
    if (e.type != HD_ENTRY_STACK) continue;
    uint64_t frames[64];
    hd_trace_counters c{};
    size_t n;
    ASSERT_EQ(hd_res_reader_stack(t.res, e.key, frames, 64, &n, &c, nullptr), HD_READ_OK);
    if (c.allocated_blocks == 0 || c.allocated_bytes % c.allocated_blocks != 0) continue;
    const uint64_t size = c.allocated_bytes / c.allocated_blocks;
    if ((size < 5101 || size > 5105) && size != 1 << 20) continue;
    EXPECT_EQ(by_size.count(size), 0u) << "two traces allocate " << size << " bytes";
    by_size[size] = c;
  }
  const uint64_t rounds = 1000;
  ASSERT_EQ(by_size.size(), 6u);
  EXPECT_EQ(by_size[5101].allocated_blocks, rounds);
  EXPECT_EQ(by_size[5101].temporary_blocks, rounds);
  EXPECT_EQ(by_size[5102].temporary_blocks, 0u);
  EXPECT_EQ(by_size[5103].allocated_blocks, rounds);
  EXPECT_EQ(by_size[5103].temporary_blocks, 0u);
  EXPECT_EQ(by_size[5104].temporary_blocks, rounds);
  EXPECT_EQ(by_size[1 << 20].allocated_blocks, rounds);
  EXPECT_EQ(by_size[1 << 20].temporary_blocks, rounds);
  EXPECT_EQ(by_size[5105].allocated_blocks, 50u);
  EXPECT_EQ(by_size[5105].temporary_blocks, 0u);
}

// What was live at the peak mark as a reader finds it, by block size: the live blocks allocated
// by the mark, and each trace's blocks live then and freed since (counted at the average size of
// the trace's, which is theirs where a trace allocates one size). *total: their bytes.
std::map<uint64_t, uint64_t> AtPeak(const Tables &t, uint64_t *total) {
  std::map<uint64_t, uint64_t> at_peak;
  for (const auto &[key, c] : t.counters) {
    if (hd_peak_mark_number(c.peak_freed_bytes) != hd_peak_mark_number(t.stats.peak_mark)) continue;
    const uint64_t blocks = hd_peak_mark_value(c.peak_freed_blocks);
    const uint64_t bytes = hd_peak_mark_value(c.peak_freed_bytes);
    *total += bytes;
    if (blocks != 0) at_peak[bytes / blocks] += blocks;
  }
  for (const auto &b : t.blocks) {
    if (!hd_peak_allocated_by(b.timestamp, t.stats.start_time_ns, t.stats.peak_mark)) continue;
    *total += b.size;
    at_peak[b.size]++;
  }
  return at_peak;
}

// What was live at the peak mark, as a reader finds it (child.cc, scenario_peak): the live
// blocks allocated by the mark, and each trace's count of blocks live then and freed since.
TEST_P(Preload, ThePeakMarkKnowsWhatWasLiveAtThePeakAfterItWasFreed) {
  Tables t;
  RunChild({"peak"}, &t);
  ASSERT_NE(hd_peak_mark_number(t.stats.peak_mark), 0u);
  uint64_t total = 0;
  std::map<uint64_t, uint64_t> at_peak = AtPeak(t, &total);
  // The mark: within 1% below the highest live bytes, and what the tables add up to then.
  EXPECT_LE(t.stats.peak_mark_bytes, t.stats.peak_live_bytes);
  EXPECT_GE(t.stats.peak_mark_bytes, t.stats.peak_live_bytes * 99 / 100);
  std::string sizes;
  for (auto &[size, blocks] : at_peak)
    sizes += std::to_string(size) + "x" + std::to_string(blocks) + " ";
  EXPECT_EQ(total, t.stats.peak_mark_bytes) << sizes;
  // All the 6001s, all but the last 1% of the 6002s (one thread: the mark is where the live
  // bytes rose past 1% above the last one), none of what came after.
  EXPECT_EQ(at_peak[6001], 2000u);
  EXPECT_GE(at_peak[6002], 1000u - (t.stats.peak_live_bytes / 100) / 6002 - 1);
  EXPECT_LE(at_peak[6002], 1000u);
  EXPECT_EQ(at_peak[6003], 0u);
  EXPECT_EQ(at_peak[6004], 0u);
  EXPECT_EQ(t.CountSize(6003), 1000);
}

// The same with four threads, each of which may hold back its share of the live bytes (up to
// HD_LIVE_DELTA_FLUSH) from the total the marks are taken from (child.cc, scenario_peak_threads).
TEST_P(Preload, ThePeakMarkOfFourThreadsIsWithinWhatTheyHoldBack) {
  Tables t;
  RunChild({"peak-threads"}, &t);
  ASSERT_NE(hd_peak_mark_number(t.stats.peak_mark), 0u);
  const uint64_t held_back = 5 * (64u << 10);  // four threads and the main one
  uint64_t total = 0;
  std::map<uint64_t, uint64_t> at_peak = AtPeak(t, &total);
  EXPECT_GE(t.stats.peak_mark_bytes + held_back, t.stats.peak_live_bytes * 99 / 100);
  EXPECT_NEAR(static_cast<double>(total), static_cast<double>(t.stats.peak_mark_bytes),
              static_cast<double>(held_back));
  uint64_t held = 0, kept = 0;
  for (uint64_t n = 0; n < 4; n++) {
    held += at_peak[4000 + n];
    kept += at_peak[7000 + n];
  }
  EXPECT_LE(held, 2000u);
  EXPECT_GE(held, 2000u - (t.stats.peak_live_bytes / 100 + held_back) / 4000);
  EXPECT_EQ(kept, 0u);
}

TEST_P(Preload, ThreadsExitingDuringAllocationStorms) {
  Tables t;
  RunChild({"thread-churn"}, &t);
  EXPECT_EQ(t.CountSize(4321), 60 * 8);
  EXPECT_EQ(t.CountSize(4322), 4 * 10);
  EXPECT_EQ(t.CountSize(4323), 0);  // freed by a pthread key destructor at thread exit
  EXPECT_EQ(t.CountSize(4324), 0);  // freed by a thread_local destructor at thread exit
  EXPECT_EQ(t.CountSize(5000), 0);
  EXPECT_EQ(t.stats.live_blocks, t.blocks.size());
}

TEST_P(Preload, MemoryCapDropsRecordsAndTheProgramGoesOn) {
  Tables t;
  RunChild({"cap"}, &t, {"HEAPDUMP_MAX_MEMORY=1M"});
  EXPECT_GT(t.stats.dropped_allocations, 0u);
  EXPECT_GT(t.stats.dropped_stack_traces, 0u);
  EXPECT_EQ(t.stats.live_blocks, t.blocks.size());
  EXPECT_LT(t.blocks.size(), 60000u);
  EXPECT_EQ(t.CountSize(25), 100);  // recorded again once records were freed
  // Every recorded trace key still names a readable trace.
  for (auto &b : t.blocks) {
    if (b.stack_key == 0) continue;
    uint64_t frames[64];
    size_t n;
    ASSERT_EQ(hd_res_reader_stack(t.res, b.stack_key, frames, 64, &n, nullptr, nullptr),
              HD_READ_OK);
  }
}

TEST_P(Preload, RenameThroughProcCommIsNoticed) {
  Tables t;
  RunChild({"comm-rename"}, &t);
  std::map<uint32_t, std::string> names;
  for (auto &e : t.Entries(HD_ENTRY_THREAD)) names[e.key] = e.u.thread.name;
  ASSERT_EQ(t.CountSize(5551), 1);
  ASSERT_EQ(t.CountSize(5553), 1);
  EXPECT_EQ(names[t.FindSize(5551)->thread_key], "before-rename");
  EXPECT_EQ(names[t.FindSize(5553)->thread_key], "after-rename");
}

// Real-time threads preempting each other inside the library on one CPU: no livelock (the child
// kills itself with an alarm after 60 s if it hangs).
TEST_P(Preload, RealTimeThreadsOnOneCpuNeverLivelock) {
  Tables t;
  RunChild({"realtime"}, &t);
  if (last_output.find("realtime unavailable") != std::string::npos) {
    GTEST_SKIP() << "SCHED_FIFO is not permitted here (needs root or RLIMIT_RTPRIO)";
  }
  EXPECT_NE(last_output.find("realtime done"), std::string::npos) << last_output;
}

// What glibc refuses (64 TiB, a 1 TiB calloc or alignment) fails with ENOMEM whatever the
// backend; small blocks are 16-byte aligned.
TEST_P(Preload, ImpossibleSizesFailAsWithGlibc) {
  Tables t;
  RunChild({"impossible"}, &t);
  EXPECT_NE(last_output.find("impossible done"), std::string::npos) << last_output;
}

TEST_P(Preload, PublicApiThroughWeakSymbols) {
  Tables t;
  RunChild({"api"}, &t);
  EXPECT_EQ(t.CountSize(3333), 1);
}

// The value after "key=" on the line starting with `line` of the child's output, or "" if none.
static std::string Field(const std::string &out, const std::string &line, const std::string &key) {
  size_t at = out.find(line);
  if (at == std::string::npos) return "";
  size_t end = out.find('\n', at);
  std::string l = out.substr(at, end - at);
  size_t k = l.find(key + "=");
  if (k == std::string::npos) return "";
  k += key.size() + 1;
  return l.substr(k, l.find(' ', k) == std::string::npos ? std::string::npos : l.find(' ', k) - k);
}

// The library adds no thread to the program: one that allocates and keeps 2,000,000 blocks
// counts one thread in /proc/self/task all along. What the kernel allows only a process of one
// thread (setns and unshare into user namespaces, right after growing), and no thread keeping
// root after setresuid (as root), are as they are without the library.
TEST_P(Preload, TheProgramKeepsItsOneThreadWhileTheTablesGrow) {
  Tables t;
  RunChild({"one-thread"}, &t);
  const std::string with = last_output;
  EXPECT_NE(with.find("threads-seen=1\n"), std::string::npos) << with;
  const bool setns_ran = Field(with, "setns", "setns") != "unavailable";
  EXPECT_EQ(t.CountSize(32), 2000000 + 20000 + (setns_ran ? 20000 : 0));
  Ran without = RunToEnd({HD_CHILD, "one-thread"}, Env(false, {}));
  ASSERT_EQ(without.status, 0) << without.out;
  for (const char *key : {"setns", "unshare", "creds"}) {
    EXPECT_EQ(Field(with, key, key), Field(without.out, key, key)) << with << without.out;
  }
  if (Field(without.out, "setns", "setns") == "unavailable") {
    std::printf("user namespaces are not available here: setns and unshare not exercised\n");
  }
}

// A sandbox that kills the process at any new thread (seccomp on clone and clone3) does not
// kill a profiled program, however much its tables grow.
TEST_P(Preload, ASandboxThatForbidsThreadsDoesNotKillTheProgram) {
  Tables t;
  RunChild({"seccomp-no-clone"}, &t);
  EXPECT_NE(last_output.find("survived\n"), std::string::npos) << last_output;
  EXPECT_EQ(t.CountSize(40), 1000000);
}

INSTANTIATE_TEST_SUITE_P(
    Backends, Preload,
    ::testing::Values(Config{"jemalloc_cfi", {}},
                      Config{"system_cfi", {"HEAPDUMP_ALLOCATOR=system"}},
                      Config{"jemalloc_libunwind", {"HEAPDUMP_UNWIND=libunwind"}},
                      Config{"system_libunwind",
                             {"HEAPDUMP_ALLOCATOR=system", "HEAPDUMP_UNWIND=libunwind"}},
                      Config{"jemalloc_fp", {"HEAPDUMP_UNWIND=fp"}},
                      Config{"system_fp", {"HEAPDUMP_ALLOCATOR=system", "HEAPDUMP_UNWIND=fp"}}),
    [](const ::testing::TestParamInfo<Config> &i) { return std::string(i.param.name); });

TEST(PreloadApi, WeakApiWithoutLibrary) {
  Ran r = RunToEnd({HD_CHILD, "api"}, Env(false, {}));
  EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0);
  EXPECT_EQ(r.out, "not-loaded\nready\n");
}

// A process the library does not record (HEAPDUMP_PROFILE_ONLY names another program) has no
// tables and no unwinder: its dlopen and dlclose still pass through the library's hooks, which
// must touch neither. Under every unwinder.
TEST(PreloadEnv, AProcessThatRecordsNothingLoadsAndUnloadsModules) {
  for (const char *unwind : {"cfi", "libunwind", "fp", "compare"}) {
    Ran r = RunToEnd({HD_CHILD, "dlopen", HD_TEST_LIB},
                     Env(true, {"HEAPDUMP_PROFILE_ONLY=another-program",
                                std::string("HEAPDUMP_UNWIND=") + unwind}));
    EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0)
        << unwind << ": status " << r.status << " " << r.out;
  }
}

TEST(PreloadEnv, FollowChildrenZeroStripsLdPreload) {
  for (const char *follow : {"0", "1"}) {
    Ran r = RunToEnd({"/bin/sh", "-c", "echo \"[$LD_PRELOAD]\""},
                     Env(true, {std::string("HEAPDUMP_FOLLOW_CHILDREN=") + follow}));
    int st = r.status;
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    if (follow[0] == '0')
      EXPECT_EQ(r.out, "[]\n");
    else
      EXPECT_EQ(r.out, std::string("[") + HD_PRELOAD_LIB + "]\n");
  }
}

// Real Debian programs behave identically with and without the library, on both backends.
struct RealProgram {
  const char *name;
  std::vector<std::string> argv;
};

class RealPrograms : public ::testing::TestWithParam<RealProgram> {};

TEST_P(RealPrograms, SameOutputAndStatus) {
  const auto &argv = GetParam().argv;
  if (access(argv[0].c_str(), X_OK) != 0) GTEST_SKIP() << argv[0] << " not installed";
  Ran plain = RunToEnd(argv, Env(false, {}));
  for (std::vector<std::string> extra : {std::vector<std::string>{},
                                         {"HEAPDUMP_ALLOCATOR=system"},
                                         {"HEAPDUMP_UNWIND=fp"},
                                         {"HEAPDUMP_UNWIND=libunwind"}}) {
    Ran r = RunToEnd(argv, Env(true, extra));
    EXPECT_EQ(r.status, plain.status) << (extra.empty() ? "" : extra[0]);
    EXPECT_EQ(r.out, plain.out) << (extra.empty() ? "" : extra[0]);
  }
  EXPECT_FALSE(plain.out.empty());
}

INSTANTIATE_TEST_SUITE_P(
    Debian, RealPrograms,
    ::testing::Values(
        RealProgram{"perl_hash",
                    {"/usr/bin/perl", "-e",
                     "my %h; $h{$_} = $_ x 3 for 1..200000; delete $h{$_} for 1..100000;"
                     " print scalar(keys %h), \"\\n\"; exit 3"}},
        RealProgram{"python3",
                    {"/usr/bin/python3", "-c",
                     "import json,threading\n"
                     "d=[{'k':i,'v':str(i)*5} for i in range(100000)]\n"
                     "ts=[threading.Thread(target=lambda: sorted(map(str,range(50000)))) for _ in "
                     "range(4)]\n"
                     "[t.start() for t in ts]; [t.join() for t in ts]\n"
                     "print(len(json.dumps(d)))"}},
        RealProgram{"git_version", {"/usr/bin/git", "--version"}},
        RealProgram{"sh_pipeline",
                    {"/bin/sh", "-c",
                     "seq 1 20000 | sort -r | head -3; ls /nonexistent 2>/dev/null; exit 7"}}),
    [](const ::testing::TestParamInfo<RealProgram> &i) { return std::string(i.param.name); });

// Our unwinder against libunwind, the oracle: with HEAPDUMP_UNWIND=compare every allocation of a
// real program is unwound both ways, and each process says at exit how many stacks were
// compared, how many differed, how many ours left to libunwind, how many of its traces were
// reused without a walk, and how many walks joined the thread's previous walk (validated trace
// reuse, cfi.h). Ours must give exactly libunwind's trace every time, reused, joined or walked,
// and leave it almost nothing.
struct UnwindWorkload {
  const char *name;
  std::string script;  // run by bash as the last step (exec), in a scratch directory
  size_t min_compared;
  size_t min_reused;
  const char *needs = nullptr;  // a program that must be installed, else the test is skipped
  // It allocates where ours leaves the stack to libunwind by design: on stacks the program made
  // itself, or in a module's constructors, which dlopen runs before the module list is updated.
  bool leaves_stacks = false;
  size_t min_joined = 0;
};

void PrintTo(const UnwindWorkload &w, std::ostream *os) { *os << w.name; }

class Unwinders : public ::testing::TestWithParam<UnwindWorkload> {};

TEST_P(Unwinders, OursGivesLibunwindsTraceForEveryAllocation) {
  const UnwindWorkload &w = GetParam();
  if (w.needs != nullptr && access(w.needs, X_OK) != 0) GTEST_SKIP() << w.needs << " not installed";
  const std::string dir = hdtest::TempDir("unwind");
  hdtest::RemoveWhenPassed cleanup{dir};
  hdtest::WriteFile(dir + "/t.cc",
                    "#include <algorithm>\n#include <map>\n#include <string>\n#include <vector>\n"
                    "template <int N> struct F { static int v() { return N + F<N - 1>::v(); } };\n"
                    "template <> struct F<0> { static int v() { return 0; } };\n"
                    "int main() { std::map<std::string, std::vector<int>> m; "
                    "m[\"a\"].push_back(F<300>::v()); std::sort(m[\"a\"].begin(), m[\"a\"].end()); "
                    "return (int)m.size(); }\n");
  hdtest::ShellOutput run = hdtest::RunShell(w.script, dir, Env(true, {"HEAPDUMP_UNWIND=compare"}));
  ASSERT_EQ(run.status, 0) << run.out;
  size_t processes = 0, compared = 0, differed = 0, left = 0, reused = 0, joined = 0;
  for (const std::string &line : hdtest::Lines(run.out)) {
    unsigned long long c, d, l, r, j;
    if (sscanf(line.c_str(),
               "heapdump: unwinders compared on %llu stacks: %llu differ; %llu left to libunwind; "
               "%llu reused; %llu joined an earlier walk",
               &c, &d, &l, &r, &j) != 5) {
      continue;
    }
    processes++;
    compared += c;
    differed += d;
    left += l;
    reused += r;
    joined += j;
  }
  ASSERT_GT(processes, 0u) << run.out;
  EXPECT_EQ(differed, 0u) << run.out;
  EXPECT_GE(compared, w.min_compared) << run.out;
  EXPECT_GE(reused, w.min_reused) << run.out;
  EXPECT_GE(joined, w.min_joined) << run.out;
  // What ours leaves: allocations made before the unwinder knows a module (constructors that
  // dlopen runs, the loader's own start-up code, which has no call-frame information).
  if (!w.leaves_stacks) {
    EXPECT_LE(left, 2 * processes + compared / 10000) << run.out;
  }
}

INSTANTIATE_TEST_SUITE_P(
    RealPrograms, Unwinders,
    ::testing::Values(
        UnwindWorkload{"perl", "exec /usr/bin/perl -e 'my %h; $h{$_} = $_ x 3 for 1..200000;'",
                       100000, 10000},
        UnwindWorkload{
            "python3_threads",
            "exec /usr/bin/python3 -c 'import json,threading\n"
            "d=[{\"k\":i} for i in range(50000)]\n"
            "ts=[threading.Thread(target=lambda: sorted(map(str,range(20000)))) for _ in "
            "range(4)]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]; print(len(json.dumps(d)))'",
            1000, 50},  // (most of Python's allocations come from its own arenas)
        UnwindWorkload{"gxx", "exec g++ -O2 -c t.cc -o t.o", 100000, 1000, "/usr/bin/g++", false,
                       10000},
        UnwindWorkload{"cppcheck", "exec cppcheck -q t.cc", 1000, 100, "/usr/bin/cppcheck", false,
                       100},
        // (Not coreutils: they close stderr before the summary is written.)
        UnwindWorkload{"bash_loop",
                       "exec bash -c 'for i in $(seq 1 2000); do x=$x$i; done; echo ${#x}'", 1000,
                       100},
        UnwindWorkload{"signal_handlers", std::string("exec ") + HD_CHILD + " signals </dev/null",
                       10000, 1000},
        UnwindWorkload{"alternate_signal_stack",
                       std::string("exec ") + HD_CHILD + " signals-altstack </dev/null", 10000,
                       1000},
        UnwindWorkload{"threads_exiting_while_others_allocate",
                       std::string("exec ") + HD_CHILD + " thread-churn </dev/null", 100000, 10000},
        UnwindWorkload{"threads", std::string("exec ") + HD_CHILD + " threads </dev/null", 10000,
                       1000},
        UnwindWorkload{"dlopen",
                       std::string("exec ") + HD_CHILD + " dlopen " + HD_TEST_LIB + " </dev/null",
                       5, 0},
        UnwindWorkload{"cxx", std::string("exec ") + HD_CHILD + " cxx </dev/null", 5, 0},
        UnwindWorkload{"git", "exec git init -q repo", 100, 0, "/usr/bin/git"},
        // Built -O2 -fomit-frame-pointer (unwind_child.cc):
        UnwindWorkload{"same_site_other_callers",
                       std::string("exec ") + HD_UNWIND_CHILD + " callers", 300000, 100000},
        UnwindWorkload{"deep_branching_paths", std::string("exec ") + HD_UNWIND_CHILD + " branches",
                       150000, 1000, nullptr, false, 100000},
        UnwindWorkload{"same_frames_other_rbp",
                       std::string("exec ") + HD_UNWIND_CHILD + " carried_rbp", 100000, 0, nullptr,
                       false, 90000},
        UnwindWorkload{"exceptions", std::string("exec ") + HD_UNWIND_CHILD + " exceptions", 10000,
                       100},
        UnwindWorkload{"longjmp", std::string("exec ") + HD_UNWIND_CHILD + " longjmp", 100000,
                       1000},
        UnwindWorkload{"realigned_stack", std::string("exec ") + HD_UNWIND_CHILD + " realigned",
                       20000, 1000},
        UnwindWorkload{"signals_in_plt_entries", std::string("exec ") + HD_UNWIND_CHILD + " plt",
                       100, 0},
        UnwindWorkload{"coroutines", std::string("exec ") + HD_UNWIND_CHILD + " coroutines", 2000,
                       1000, nullptr, true},
        UnwindWorkload{"modules_glibc_loads_itself",
                       std::string("exec ") + HD_UNWIND_CHILD + " iconv", 300, 0, nullptr, true},
        UnwindWorkload{"dlclose_and_reload",
                       std::string("exec ") + HD_UNWIND_CHILD + " dlclose " + HD_TEST_LIB, 10000,
                       1000, nullptr, true}),
    [](const ::testing::TestParamInfo<UnwindWorkload> &i) { return std::string(i.param.name); });

// A cache miss of our unwinder in a module loaded with the program reads its call-frame tables
// without asking the loader whether modules moved (dl_iterate_phdr, under the loader's lock):
// such a module is never unloaded. The child drops every cached rule (a dlopen and a dlclose)
// before each round of allocations, so each round's walks miss in every frame; a counting
// dl_iterate_phdr preloaded ahead of the library sees the calls.
TEST(UnwinderMisses, AskTheLoaderNothingInModulesLoadedWithTheProgram) {
  std::vector<std::string> env = Env(false, {"HEAPDUMP_UNWIND=cfi"});
  env.push_back(std::string("LD_PRELOAD=") + HD_LOADER_COUNTER + " " + HD_PRELOAD_LIB);
  Ran ran = RunToEnd({HD_UNWIND_CHILD, "loader"}, env);
  ASSERT_EQ(ran.status, 0) << ran.out;
  EXPECT_NE(ran.out.find("loader calls while allocating: 0\n"), std::string::npos) << ran.out;
}

}  // namespace
