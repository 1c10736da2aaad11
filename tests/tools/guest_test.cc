// What a profiled program sees of heapdump: an allocator and nothing else. The library's
// dependencies and exports as the dynamic linker sees them; C++ in modules that C programs load
// (python3 through ctypes, a C program's dlopen) recorded exactly; a C program's leak check
// showing its own blocks and none of ours. Real programs under `heapdump run`, compared with
// valgrind's memcheck where it is installed.
#include <unistd.h>

#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "leak_report.h"
#include "process.h"

namespace {

using hdtest::Lines;

class Guest : public ::testing::Test {
 protected:
  std::string dir = hdtest::TempDir("guest");
  hdtest::RemoveWhenPassed cleanup{dir};

  hdtest::ShellOutput Shell(const std::string &script) {
    return hdtest::RunShell(
        script, dir,
        {"PATH=" + std::string(HD_BIN_DIRS) + ":/usr/bin:/bin",
         "HEAPDUMP_SOCKET=" + dir + "/none.sock", "TMPDIR=" + dir, "HOME=" + dir});
  }
};

// Each word of a command's output, one per line, as a set.
std::set<std::string> Words(const std::string &text) {
  std::set<std::string> words;
  std::istringstream in(text);
  for (std::string w; in >> w;) words.insert(w);
  return words;
}

using hdtest::Amount;
using hdtest::LostAt;
using Groups = hdtest::LeakGroups;
Groups LeakGroups(const std::string &report) { return hdtest::ParseLeakGroups(report); }
std::map<std::string, Amount> MemcheckSummary(const std::string &out) {
  return hdtest::ParseMemcheckSummary(out);
}

bool Installed(const char *program) { return access(program, X_OK) == 0; }

TEST_F(Guest, TheLibraryNeedsTheCLibraryAndTheLoaderOnly) {
  hdtest::ShellOutput needed = Shell(std::string("readelf -d ") + HD_PRELOAD_LIB +
                                     " | sed -n 's/.*(NEEDED).*\\[\\(.*\\)\\]/\\1/p'");
  ASSERT_EQ(needed.status, 0) << needed.out;
  EXPECT_EQ(Words(needed.out), (std::set<std::string>{"libc.so.6"})) << needed.out;
  // What the loader brings with it, recursively.
  hdtest::ShellOutput ldd = Shell(std::string("ldd ") + HD_PRELOAD_LIB + " | awk '{print $1}'");
  ASSERT_EQ(ldd.status, 0) << ldd.out;
  EXPECT_EQ(Words(ldd.out),
            (std::set<std::string>{"linux-vdso.so.1", "libc.so.6", "/lib64/ld-linux-x86-64.so.2"}))
      << ldd.out;
}

TEST_F(Guest, TheLibraryExportsTheAllocationApiAndItsHooksOnly) {
  hdtest::ShellOutput exports =
      Shell(std::string("nm -D --defined-only ") + HD_PRELOAD_LIB + " | awk '{print $3}'");
  ASSERT_EQ(exports.status, 0) << exports.out;
  EXPECT_EQ(
      Words(exports.out),
      (std::set<std::string>{
          // the malloc family
          "malloc", "free", "calloc", "realloc", "reallocarray", "posix_memalign", "aligned_alloc",
          "memalign", "valloc", "pvalloc", "malloc_usable_size", "free_sized", "free_aligned_sized",
          // jemalloc's API, for programs that call it
          "mallocx", "rallocx", "xallocx", "sallocx", "nallocx", "dallocx", "sdallocx",
          // modules and thread names
          "dlopen", "dlclose", "prctl", "pthread_setname_np",
          // the public API
          "heapdump_get_stats", "heapdump_get_stats_sized", "heapdump_take_named_snapshot"}))
      << exports.out;
}

// A C program's leak check holds its own two blocks and nothing else: no library of ours
// allocates in it (a libstdc++ brought in by a dependency once left its 72,704-byte pool there).
TEST_F(Guest, ACProgramsLeakCheckHoldsItsOwnBlocksOnly) {
  hdtest::ShellOutput run = Shell(std::string("heapdump run --show-reachable --top 0 -- ") +
                                  HD_GUEST_TWO_BLOCKS + " 2>&1");
  ASSERT_EQ(run.status, 0) << run.out;
  EXPECT_EQ(LeakGroups(run.out), (Groups{{{"DEFINITELY LOST", "lose"}, {200, 1}},
                                         {{"STILL REACHABLE", "keep"}, {100, 1}}}))
      << run.out;
  EXPECT_NE(run.out.find(": 2 live blocks, 300 live bytes;"), std::string::npos) << run.out;
  if (!Installed("/usr/bin/valgrind")) GTEST_SKIP() << "valgrind is not installed";
  hdtest::ShellOutput memcheck =
      Shell(std::string("valgrind --leak-check=full --show-leak-kinds=all ") + HD_GUEST_TWO_BLOCKS +
            " 2>&1");
  auto summary = MemcheckSummary(memcheck.out);
  EXPECT_EQ(summary["definitely lost"], (Amount{200, 1})) << memcheck.out;
  EXPECT_EQ(summary["still reachable"], (Amount{100, 1})) << memcheck.out;
}

// A C program loads a C++ module: its new and delete are the module's libstdc++'s, which calls
// the library's malloc. Every block is recorded where the module made it, the sized delete
// frees, and the failing new runs the new_handler as libstdc++ does, then throws.
TEST_F(Guest, CxxInAModuleThatACProgramLoadsIsRecorded) {
  hdtest::ShellOutput run = Shell(std::string("heapdump run --show-reachable --top 0 -- ") +
                                  HD_GUEST_MAIN + " " + HD_GUEST_MODULE + " 2>&1");
  ASSERT_EQ(run.status, 0) << run.out;
  EXPECT_NE(run.out.find("libstdc++ before the module: no\n"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("strings: 1000\n"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("new_handler calls: 2\n"), std::string::npos) << run.out;
  const Groups groups = LeakGroups(run.out);
  // 1,000 string objects of 32 bytes lost, and their 1,001-byte buffers through them: all at
  // the module's function, and nothing else lost. (memcheck counts all 1,000 objects definitely
  // lost; here one may be indirectly lost: the allocator gave a string object the memory of a
  // vector buffer it had freed, whose stale pointer to another string lies in the object's
  // unused bytes, and a conservative scan follows it. memcheck never reuses memory so soon.)
  EXPECT_EQ(LostAt(groups, "guest_make_strings"), (Amount{32000 + 1001000, 2000})) << run.out;
  EXPECT_GE(groups.at({"DEFINITELY LOST", "guest_make_strings"}).second, 990u) << run.out;
  for (const auto &[key, value] : groups) {
    if (key.first != "STILL REACHABLE") {
      EXPECT_EQ(key.second, "guest_make_strings") << run.out;
    }
  }
  // new[] and the aligned new, kept by the module's globals.
  EXPECT_EQ(groups.at({"STILL REACHABLE", "guest_exercise_new"}), (Amount{54321 + 512, 2}))
      << run.out;
}

// python3 (Debian's) loads the same module through ctypes: the 2,000 blocks the module loses
// are recorded and lost at its function, as memcheck finds them (and, as above, whether each is
// lost directly or through another may differ; their sum does not).
TEST_F(Guest, Python3LoadingACxxModuleThroughCtypesIsRecorded) {
  if (!Installed("/usr/bin/python3")) GTEST_SKIP() << "python3 is not installed";
  const std::string script = std::string("import ctypes\nm = ctypes.CDLL('") + HD_GUEST_MODULE +
                             "')\nprint(m.guest_make_strings(1000))\n";
  hdtest::ShellOutput run =
      Shell("cat > load.py <<'EOF'\n" + script +
            "EOF\nheapdump run --show-reachable --top 0 -- /usr/bin/python3 load.py 2>&1");
  ASSERT_EQ(run.status, 0) << run.out;
  EXPECT_EQ(run.out.rfind("1000\n", 0), 0u) << run.out;
  // Python's arenas are roots (memory it mapped itself) and keep stale copies of pointers: a
  // string may be reached through one into its middle, possibly lost here where memcheck (whose
  // run lays memory out otherwise) has it lost. None of the 2,000 is still reachable.
  const Groups groups = LeakGroups(run.out);
  Amount lost = LostAt(groups, "guest_make_strings");
  auto possibly = groups.find({"POSSIBLY LOST", "guest_make_strings"});
  if (possibly != groups.end()) {
    lost.first += possibly->second.first;
    lost.second += possibly->second.second;
  }
  EXPECT_EQ(lost, (Amount{32000 + 1001000, 2000})) << run.out;
  EXPECT_EQ(groups.count({"STILL REACHABLE", "guest_make_strings"}), 0u) << run.out;
  if (!Installed("/usr/bin/valgrind")) GTEST_SKIP() << "valgrind is not installed";
  hdtest::ShellOutput memcheck = Shell("valgrind --leak-check=full /usr/bin/python3 load.py 2>&1");
  auto summary = MemcheckSummary(memcheck.out);
  EXPECT_EQ(summary["definitely lost"].first + summary["indirectly lost"].first, lost.first)
      << memcheck.out;
  EXPECT_EQ(summary["definitely lost"].second + summary["indirectly lost"].second, lost.second)
      << memcheck.out;
}

}  // namespace
