// The dormant library armed on demand, as users run it: a busy program (four threads allocating,
// reallocating and freeing across threads, under a storm of signals whose handler allocates)
// started with HEAPDUMP_DORMANT=1 or from /etc/ld.so.preload, armed and disarmed again and again
// with `heapdump arm` / `heapdump disarm` while it runs; redis-server under redis-benchmark's
// load armed and disarmed the same way; and the refusals users meet.
#include <dirent.h>
#include <pwd.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <cmath>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "browser.h"
#include "leak_report.h"
#include "process.h"

namespace {

bool Installed(const char *program) { return access(program, X_OK) == 0; }

// Whether process pid holds the library's tables (it records).
bool HasTables(pid_t pid) {
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR *d = opendir(dir.c_str());
  if (d == nullptr) return false;
  bool found = false;
  while (dirent *e = readdir(d)) {
    char target[256] = {0};
    if (readlink((dir + "/" + e->d_name).c_str(), target, sizeof target - 1) > 0 &&
        std::string(target).find("heapdump-allocations") != std::string::npos) {
      found = true;
    }
  }
  closedir(d);
  return found;
}

// A number field of a `report --json` text, from the first occurrence of `key` after `from`;
// -1 if absent.
double Field(const std::string &json, const std::string &key, size_t from = 0) {
  const size_t at = json.find("\"" + key + "\":", from);
  if (at == std::string::npos) return -1;
  return std::stod(json.substr(at + key.size() + 3, 24));
}

// A site's live blocks and bytes in a `report --json` text (0, 0 if it is not there).
struct Live {
  double blocks = 0, bytes = 0;
};
Live SiteOf(const std::string &json, const std::string &site) {
  Live live;
  const std::string name = "{\"name\":\"" + site + "\"";
  for (size_t at = json.find(name); at != std::string::npos; at = json.find(name, at + 1)) {
    live.blocks += Field(json, "live_blocks", at);
    live.bytes += Field(json, "live_bytes", at);
  }
  return live;
}

class Dormant : public ::testing::Test {
 protected:
  std::string dir = hdtest::TempDir("dormant");
  hdtest::RemoveWhenPassed cleanup{dir};
  hdtest::Collector daemon{dir + "/daemon"};

  void SetUp() override { daemon.Start(); }

  std::vector<std::string> Env() const {
    return {"PATH=" + std::string(HD_BIN_DIRS) + ":/usr/bin:/bin",
            "HEAPDUMP_SOCKET=" + daemon.socket, "TMPDIR=" + dir, "HOME=" + dir};
  }
  hdtest::ShellOutput Shell(const std::string &script) {
    return hdtest::RunShell(script, dir, Env());
  }
  // A snapshot of pid, reported as JSON.
  std::string Report(pid_t pid) {
    const std::string p = std::to_string(pid);
    hdtest::ShellOutput o = Shell("heapdump snapshot --pid " + p + " -o s.heapdump >/dev/null\n" +
                                  "heapdump report s.heapdump --json --top 0\n");
    EXPECT_EQ(o.status, 0) << o.out;
    return o.out;
  }
  // The dormant child, started and ready; its pid.
  // launcher: a command that execs the child (its argv before the child's); socket: its
  // collector's, when not the fixture's.
  pid_t StartChild(std::unique_ptr<hdtest::Program> *child, const std::string &dormant = "1",
                   std::vector<std::string> launcher = {}, const std::string &socket = "") {
    std::vector<std::string> env = hdtest::InstrumentedEnv(socket.empty() ? daemon.socket : socket);
    env.push_back("HEAPDUMP_DORMANT=" + dormant);
    launcher.push_back(HD_DORMANT_CHILD);
    child->reset(new hdtest::Program(launcher, env));
    const std::string ready = (*child)->ReadLine();
    EXPECT_EQ(ready.rfind("ready ", 0), 0u) << ready;
    return ready.rfind("ready ", 0) == 0 ? std::stoi(ready.substr(6)) : -1;
  }
  // Dormant.AnAllocationInASignalHandlerNeverArms, in a quiet child that refuses
  // process_vm_readv or not.
  void AllocateInASignalHandlerThenOutside(bool refuse_process_vm_readv);
  // Empty if a mount namespace with an overlay on /etc can be made here, else why not.
  std::string CannotOverlayEtc() {
    const std::string probe =
        Shell(
            "mkdir -p probe/u probe/w && unshare -m --propagation private sh -c "
            "'mount -t overlay overlay -o lowerdir=/etc,upperdir=probe/u,workdir=probe/w /etc' "
            "&& echo can")
            .out;
    return probe.find("can") == std::string::npos ? probe + " " : "";
  }
  // The start of a command line, for `sh -c` in a mount namespace of its own: an overlay on
  // /etc whose ld.so.preload names this build's library (after `spaces` blanks), then `exec ` of
  // what follows.
  std::string EtcLdSoPreloadThenExec(size_t spaces = 0) const {
    return "mkdir -p " + dir + "/ovl/u " + dir +
           "/ovl/w && mount -t overlay overlay -o lowerdir=/etc,upperdir=" + dir +
           "/ovl/u,workdir=" + dir + "/ovl/w /etc && printf '%" + std::to_string(spaces) +
           "s%s\\n' '' " + std::string(HD_PRELOAD_LIB) + " > /etc/ld.so.preload && exec ";
  }
  // The dormant child loaded by /etc/ld.so.preload alone (EtcLdSoPreloadThenExec(spaces)), its
  // library seen in its mappings; its pid, or -1.
  pid_t StartFromEtcLdSoPreload(std::unique_ptr<hdtest::Program> *child, size_t spaces = 0) {
    const std::string script = EtcLdSoPreloadThenExec(spaces) + HD_DORMANT_CHILD;
    child->reset(new hdtest::Program(
        {"/usr/bin/unshare", "-m", "--propagation", "private", "sh", "-c", script},
        {"HEAPDUMP_SOCKET=" + daemon.socket}));
    const std::string ready = (*child)->ReadLine();
    EXPECT_EQ(ready.rfind("ready ", 0), 0u) << ready;
    if (ready.rfind("ready ", 0) != 0) return -1;
    const pid_t pid = std::stoi(ready.substr(6));
    EXPECT_NE(hdtest::ReadFile("/proc/" + std::to_string(pid) + "/maps").find("libheapdump.so"),
              std::string::npos);
    return pid;
  }
  static void Command(hdtest::Program *child, const std::string &command) {
    child->Send(command);
    EXPECT_EQ(child->ReadLine(), "ok") << command;
  }
};

// Five rounds of arming and disarming, each at a moment the threads and the signal storm pick:
// armed, the process records exactly what it allocates from then on (none of the blocks it
// holds from before, which are its unattributed bytes); disarmed, it records no new block while
// its frees still take recorded ones out; its blocks from before are freed and reallocated
// safely once it records, and a fork while armed gives a child that exits cleanly.
TEST_F(Dormant, ArmingAndDisarmingUnderLoadRecordsWhatFollowsAndLosesNothing) {
  std::unique_ptr<hdtest::Program> child;
  const pid_t pid = StartChild(&child);
  ASSERT_GT(pid, 0);
  const std::string p = std::to_string(pid);
  // Dormant: no tables, nothing registered.
  EXPECT_FALSE(HasTables(pid));
  hdtest::ShellOutput none = Shell("heapdump snapshot --pid " + p + " -o x.heapdump");
  EXPECT_EQ(none.status, 4) << none.out;
  double unattributed_at_arming = -1;
  for (int round = 0; round < 5; round++) {
    SCOPED_TRACE("round " + std::to_string(round));
    hdtest::ShellOutput armed = Shell("heapdump arm --pid " + p);
    ASSERT_EQ(armed.status, 0) << armed.out;
    EXPECT_NE(armed.out.find("armed: process " + p + " (dormant_child) records every block"),
              std::string::npos)
        << armed.out;
    EXPECT_TRUE(HasTables(pid));
    const size_t size = 3000 + static_cast<size_t>(round);
    Command(child.get(), "keep 100 " + std::to_string(size));
    std::string json = Report(pid);
    EXPECT_NE(json.find("\"recording\":\"armed\""), std::string::npos) << json.substr(0, 800);
    Live kept = SiteOf(json, "keep_after");
    EXPECT_EQ(kept.blocks, 100);
    EXPECT_EQ(kept.bytes, 100.0 * static_cast<double>(size));
    EXPECT_EQ(SiteOf(json, "hold_before").blocks, 0);
    const double unattributed = Field(json, "unattributed_bytes");
    if (round == 0) {
      // hold_before's 1000 blocks of 1000 bytes, at least, and what the threads held.
      EXPECT_GE(unattributed, 1000.0 * 1000) << json.substr(0, 800);
      unattributed_at_arming = unattributed;
      // pprof's total is the process's: the unattributed bytes are a sample of their own.
      hdtest::ShellOutput top = Shell("heapdump snapshot --pid " + p +
                                      " -o armed.pb.gz >/dev/null && if command -v go >/dev/null; "
                                      "then go tool pprof -top -symbolize=none armed.pb.gz; fi");
      EXPECT_EQ(top.status, 0) << top.out;
      if (top.out.find("Type: inuse_space") != std::string::npos) {
        EXPECT_NE(top.out.find("(unattributed: allocated before arming or while disarmed)"),
                  std::string::npos)
            << top.out;
      }
      Command(child.get(), "free-before");  // frees half, reallocates the others
      json = Report(pid);
      EXPECT_LE(Field(json, "unattributed_bytes"), unattributed_at_arming - 900000)
          << json.substr(0, 800);
      // The reallocated blocks are new blocks, recorded.
      EXPECT_EQ(SiteOf(json, "main").blocks, 500) << json.substr(0, 800);
    }
    if (round == 1) Command(child.get(), "fork");
    hdtest::ShellOutput disarmed = Shell("heapdump disarm --pid " + p);
    ASSERT_EQ(disarmed.status, 0) << disarmed.out;
    EXPECT_NE(disarmed.out.find("disarmed: process " + p), std::string::npos) << disarmed.out;
    // The threads held still, so that the unattributed bytes move by the 50 blocks alone (the
    // signal handler's blocks come and go within it).
    Command(child.get(), "pause");
    const double before_keep = Field(Report(pid), "unattributed_bytes");
    Command(child.get(), "keep 50 7000");
    json = Report(pid);
    EXPECT_NE(json.find("\"recording\":\"disarmed\""), std::string::npos) << json.substr(0, 800);
    kept = SiteOf(json, "keep_after");
    EXPECT_EQ(kept.blocks, 100);  // none of the 50 allocated while disarmed
    EXPECT_EQ(kept.bytes, 100.0 * static_cast<double>(size));
    EXPECT_GE(Field(json, "unattributed_bytes"), before_keep + 50 * 7000) << json.substr(0, 800);
    Command(child.get(), "free-kept");
    json = Report(pid);
    EXPECT_EQ(SiteOf(json, "keep_after").blocks, 0);  // frees still take records out
    EXPECT_NEAR(Field(json, "unattributed_bytes"), before_keep, 4096) << json.substr(0, 800);
    Command(child.get(), "resume");
  }
  child->Send("exit");
  std::string rest;
  const int status = child->Finish(&rest);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << rest;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(rest, m, std::regex("done, ([0-9]+) signals handled"))) << rest;
  EXPECT_GT(std::stoul(m[1]), 1000u) << rest;
}

// A signal handler may have interrupted anything (glibc amid its lists, the loader amid a
// dlopen), so an allocation in one never arms the process, on the thread's stack or on an
// alternate stack in the heap; the first allocations outside a handler do, even below the
// signal frame a handler that returned left on the stack.
// The second pass runs under a seccomp filter (which refuses process_vm_readv), where the
// library reads the stack directly.
TEST_F(Dormant, AnAllocationInASignalHandlerNeverArms) {
  for (const bool refused : {false, true}) {
    SCOPED_TRACE(refused ? "process_vm_readv refused" : "process_vm_readv");
    AllocateInASignalHandlerThenOutside(refused);
  }
}

void Dormant::AllocateInASignalHandlerThenOutside(bool refuse_process_vm_readv) {
  std::vector<std::string> env = hdtest::InstrumentedEnv(daemon.socket);
  env.push_back("HEAPDUMP_DORMANT=1");
  std::vector<std::string> argv = {HD_DORMANT_CHILD, "quiet"};
  if (refuse_process_vm_readv) argv.push_back("no-process-vm-readv");
  hdtest::Program child(argv, env);
  const std::string ready = child.ReadLine();
  ASSERT_EQ(ready.rfind("ready ", 0), 0u) << ready;
  const bool refused = ready.find(" refused") != std::string::npos;
  if (refuse_process_vm_readv && !refused) GTEST_SKIP() << "no seccomp filter can be set here";
  ASSERT_FALSE(!refuse_process_vm_readv && refused) << ready;
  const std::string p = ready.substr(6, ready.find(' ', 6) - 6);
  // The quiet child allocates nothing between commands: the request waits (exit status 7).
  hdtest::ShellOutput asked = Shell("heapdump arm --timeout 1 --pid " + p);
  EXPECT_EQ(asked.status, 7) << asked.out;
  EXPECT_NE(asked.out.find("has not acted on it yet"), std::string::npos) << asked.out;
  EXPECT_NE(asked.out.find("`heapdump disarm --pid " + p + "` withdraws it"), std::string::npos)
      << asked.out;
  EXPECT_FALSE(HasTables(std::stoi(p)));
  child.Send("in-handler");
  const std::string said = child.ReadLine();
  std::smatch m;
  ASSERT_TRUE(std::regex_search(
      said, m,
      std::regex("armed in a handler: 0, on an alternate stack: 0; armed after ([0-9]+) "
                 "allocations")))
      << said;
  // Found in a handler, the thread looks again 16 allocations later.
  EXPECT_GE(std::stoi(m[1]), 1) << said;
  EXPECT_LE(std::stoi(m[1]), 100) << said;
  EXPECT_EQ(child.ReadLine(), "ok");
  Command(&child, "keep 10 1234");
  const std::string json = Report(std::stoi(p));
  EXPECT_NE(json.find("\"recording\":\"armed\""), std::string::npos) << json.substr(0, 800);
  EXPECT_EQ(SiteOf(json, "keep_after").blocks, 10);
  child.Send("exit");
  EXPECT_EQ(child.Finish(), 0);
}

// Armed at a sampling rate: the estimate of a site of known size falls within 5 standard
// deviations of it (docs/tools.md's estimator); the rate stays the process's own, so arming
// again at another is refused with a reason, and at the same one resumes it.
TEST_F(Dormant, ArmedSampledKeepsItsRate) {
  std::unique_ptr<hdtest::Program> child;
  const pid_t pid = StartChild(&child);
  ASSERT_GT(pid, 0);
  const std::string p = std::to_string(pid);
  hdtest::ShellOutput armed = Shell("heapdump arm --pid " + p + " --sample-bytes 64K");
  ASSERT_EQ(armed.status, 0) << armed.out;
  EXPECT_NE(armed.out.find("records one block per 65536 bytes"), std::string::npos) << armed.out;
  Command(child.get(), "keep 4000 4096");
  const std::string json = Report(pid);
  EXPECT_EQ(Field(json, "sample_bytes"), 65536) << json.substr(0, 800);
  // sd = s * sqrt(n (1 - p) / p) for n blocks of s bytes, p = 1 - e^(-s/N).
  const double n = 4000, s = 4096, prob = 1 - std::exp(-s / 65536);
  const double sd = s * std::sqrt(n * (1 - prob) / prob);
  EXPECT_NEAR(SiteOf(json, "keep_after").bytes, n * s, 5 * sd) << json.substr(0, 800);
  hdtest::ShellOutput other = Shell("heapdump arm --pid " + p + " --sample-bytes 128K");
  EXPECT_EQ(other.status, 2) << other.out;
  EXPECT_NE(other.out.find("was armed at another --sample-bytes"), std::string::npos) << other.out;
  ASSERT_EQ(Shell("heapdump disarm --pid " + p).status, 0);
  hdtest::ShellOutput again = Shell("heapdump arm --pid " + p + " --sample-bytes 64K");
  EXPECT_EQ(again.status, 0) << again.out;
  // Without --sample-bytes, arm resumes at the process's own rate.
  ASSERT_EQ(Shell("heapdump disarm --pid " + p).status, 0);
  hdtest::ShellOutput resumed = Shell("heapdump arm --pid " + p);
  EXPECT_EQ(resumed.status, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("records one block per 65536 bytes"), std::string::npos)
      << resumed.out;
  child->Send("exit");
  const int status = child->Finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// The leak check of an armed process: the links it appends once armed hang from links allocated
// before (no record of them): found through glibc's own chunk headers, scanned as roots, they
// keep the new links reachable, and the report says how it looked.
TEST_F(Dormant, ALeakCheckOfAnArmedProcessScansTheBlocksFromBeforeArming) {
  std::unique_ptr<hdtest::Program> child;
  const pid_t pid = StartChild(&child);
  ASSERT_GT(pid, 0);
  const std::string p = std::to_string(pid);
  ASSERT_EQ(Shell("heapdump arm --pid " + p).status, 0);
  Command(child.get(), "chain 300");
  hdtest::ShellOutput leaks = Shell("heapdump leaks --pid " + p + " --show-reachable --top 0");
  ASSERT_EQ(leaks.status, 0) << leaks.out;
  const hdtest::LeakGroups groups = hdtest::ParseLeakGroups(leaks.out);
  const auto reachable = groups.find({"STILL REACHABLE", "chain_after"});
  ASSERT_NE(reachable, groups.end()) << leaks.out;
  EXPECT_EQ(reachable->second, (hdtest::Amount{300 * 64, 300})) << leaks.out;
  for (const auto &[key, amount] : groups) {
    if (key.first != "STILL REACHABLE") {
      EXPECT_NE(key.second, "chain_after") << leaks.out;
    }
  }
  EXPECT_NE(leaks.out.find("note: armed process: the blocks not recorded were scanned as roots"),
            std::string::npos)
      << leaks.out;
  // JSON and the HTML page say it too, beside their leak summaries.
  hdtest::ShellOutput json = Shell("heapdump snapshot --pid " + p +
                                   " --contents -o leaks.heapdump >/dev/null\n"
                                   "heapdump report leaks.heapdump --json --top 0\n"
                                   "heapdump report leaks.heapdump --format html -o leaks.html\n");
  ASSERT_EQ(json.status, 0) << json.out;
  EXPECT_NE(json.out.find("\"scope_note\":\"armed process: the blocks not recorded were scanned"),
            std::string::npos)
      << json.out.substr(0, 2000);
  std::string why;
  auto browser = hdtest::Browser::Launch(&why);
  ASSERT_NE(browser, nullptr) << why;
  ASSERT_TRUE(browser->Open(dir + "/leaks.html")) << browser->error();
  ASSERT_TRUE(browser->WaitFor("document.body.dataset.ready === '1'")) << browser->error();
  const auto note = browser->EvalString(
      "(function(){const e=document.getElementById('leaks-scope-note');"
      "return e && !e.hidden && !document.getElementById('leaks').hidden ? e.textContent : "
      "'';})()");
  ASSERT_TRUE(note.has_value()) << browser->error();
  EXPECT_NE(note->find("Note: armed process: the blocks not recorded were scanned as roots"),
            std::string::npos)
      << *note;
  child->Send("exit");
  EXPECT_EQ(child->Finish(), 0);
}

// A process in a time namespace (a container's, or one restored by CRIU) reads its own start
// time shifted by the namespace's boottime offset: the collector names it so in its slot, and
// the process takes the request as its own.
TEST_F(Dormant, AProcessInATimeNamespaceIsArmed) {
  if (geteuid() != 0) GTEST_SKIP() << "a time namespace needs CAP_SYS_ADMIN";
  if (!Installed("/usr/bin/unshare")) GTEST_SKIP() << "unshare is not installed";
  std::vector<std::string> env = hdtest::InstrumentedEnv(daemon.socket);
  env.push_back("HEAPDUMP_DORMANT=1");
  hdtest::Program child({"/usr/bin/unshare", "--time", "--boottime", "100000", HD_DORMANT_CHILD},
                        env);
  const std::string ready = child.ReadLine();
  ASSERT_EQ(ready.rfind("ready ", 0), 0u) << ready;
  const std::string p = ready.substr(6);
  EXPECT_NE(hdtest::ReadFile("/proc/" + p + "/timens_offsets").find("100000"), std::string::npos);
  hdtest::ShellOutput armed = Shell("heapdump arm --timeout 5 --pid " + p);
  ASSERT_EQ(armed.status, 0) << armed.out;
  EXPECT_NE(armed.out.find("records every block"), std::string::npos) << armed.out;
  Command(&child, "keep 10 1234");
  EXPECT_EQ(SiteOf(Report(std::stoi(p)), "keep_after").blocks, 10);
  child.Send("exit");
  EXPECT_EQ(child.Finish(), 0);
}

// What users meet when the process cannot be armed: one recording since it started, one without
// the library, one that does not exist.
TEST_F(Dormant, ProcessesThatCannotBeArmedAreRefusedWithAReason) {
  std::unique_ptr<hdtest::Program> recording;
  const pid_t pid = StartChild(&recording, "0");
  ASSERT_GT(pid, 0);
  EXPECT_TRUE(HasTables(pid));
  hdtest::ShellOutput o = Shell("heapdump arm --pid " + std::to_string(pid));
  EXPECT_EQ(o.status, 4) << o.out;
  EXPECT_NE(o.out.find("does not run the dormant library of this collector"), std::string::npos)
      << o.out;
  hdtest::ShellOutput plain = Shell("sleep 30 & heapdump arm --pid $! || echo status=$?; kill $!");
  EXPECT_NE(plain.out.find("does not run the dormant library"), std::string::npos) << plain.out;
  EXPECT_NE(plain.out.find("status=4"), std::string::npos) << plain.out;
  std::unique_ptr<hdtest::Program> dormant;
  const pid_t never = StartChild(&dormant);
  ASSERT_GT(never, 0);
  hdtest::ShellOutput never_armed = Shell("heapdump disarm --pid " + std::to_string(never));
  EXPECT_EQ(never_armed.status, 4) << never_armed.out;
  EXPECT_NE(never_armed.out.find("was never armed"), std::string::npos) << never_armed.out;
  dormant->Send("exit");
  EXPECT_EQ(dormant->Finish(), 0);
  hdtest::ShellOutput gone = Shell("heapdump disarm --pid 2147483000");
  EXPECT_EQ(gone.status, 4) << gone.out;
  EXPECT_NE(gone.out.find("no process 2147483000"), std::string::npos) << gone.out;
  hdtest::ShellOutput usage = Shell("heapdump arm");
  EXPECT_EQ(usage.status, 2) << usage.out;
  EXPECT_NE(usage.out.find("arm wants --pid PID"), std::string::npos) << usage.out;
  recording->Send("exit");
  EXPECT_EQ(recording->Finish(), 0);
}

// Arming that cannot make the tables (here the address space is capped below their mapping):
// the process says why and stays dormant, its threads and their signal storm go on, and once the
// cap is lifted the next request arms it and it records exactly.
TEST_F(Dormant, AProcessThatCannotMakeItsTablesStaysDormantAndIsArmedLater) {
  if (!Installed("/usr/bin/prlimit")) GTEST_SKIP() << "prlimit is not installed";
  std::unique_ptr<hdtest::Program> child;
  const pid_t pid = StartChild(&child);
  ASSERT_GT(pid, 0);
  const std::string p = std::to_string(pid);
  // The tables map 768 MiB and 256 MiB (HEAPDUMP_MAX_MEMORY's 1 GiB); 400 MiB more than the
  // process has mapped leaves its threads' allocations room but not the tables.
  hdtest::ShellOutput capped =
      Shell("kib=$(awk '/^VmSize:/ {print $2}' /proc/" + p + "/status) && prlimit --pid " + p +
            " --as=$(( (kib + 400 * 1024) * 1024 )): && echo capped");
  ASSERT_NE(capped.out.find("capped"), std::string::npos) << capped.out;
  // It says why, at once (a timeout would take the whole --timeout); asked again, it tries again.
  for (int attempt = 0; attempt < 2; attempt++) {
    hdtest::ShellOutput refused = Shell("heapdump arm --pid " + p + " --timeout 60");
    EXPECT_EQ(refused.status, 1) << refused.out;
    EXPECT_NE(refused.out.find("arm: process " + p + " could not arm, and stays dormant"),
              std::string::npos)
        << refused.out;
    EXPECT_NE(refused.out.find("making its allocations table (768 MiB): Cannot allocate memory"),
              std::string::npos)
        << refused.out;
    EXPECT_FALSE(HasTables(pid));
  }
  Command(child.get(), "keep 100 4096");
  Command(child.get(), "free-kept");
  hdtest::ShellOutput lifted = Shell("prlimit --pid " + p + " --as=unlimited:");
  ASSERT_EQ(lifted.status, 0) << lifted.out;
  hdtest::ShellOutput armed = Shell("heapdump arm --pid " + p);
  ASSERT_EQ(armed.status, 0) << armed.out;
  EXPECT_NE(armed.out.find("records every block it allocates"), std::string::npos) << armed.out;
  EXPECT_TRUE(HasTables(pid));
  Command(child.get(), "keep 1000 4096");
  const Live kept = SiteOf(Report(pid), "keep_after");
  EXPECT_EQ(kept.blocks, 1000);
  EXPECT_EQ(kept.bytes, 1000 * 4096);
  child->Send("exit");
  const int status = child->Finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// A process that execs after it was armed (sampled): the program it execs starts dormant (the
// request was the earlier program's), is not taken for armed (a disarm is refused) nor held to its
// predecessor's rate, and is armed on its own. Also without address space randomisation (as under
// gdb, or `setarch -R`), where the program it execs would map the page where its predecessor did.
TEST_F(Dormant, AnExecdProgramStartsDormantAgain) {
  // setarch turns randomisation off with personality(2), which a container's seccomp filter may
  // refuse: that pass is skipped there.
  struct utsname machine = {};
  uname(&machine);
  std::vector<std::vector<std::string>> launchers = {{}};
  if (Shell(std::string("setarch ") + machine.machine + " -R true").status == 0)
    launchers.push_back({"/usr/bin/setarch", machine.machine, "-R"});
  for (const std::vector<std::string> &launcher : launchers) {
    SCOPED_TRACE(launcher.empty() ? "randomised" : "setarch -R");
    std::unique_ptr<hdtest::Program> child;
    const pid_t pid = StartChild(&child, "1", launcher);
    ASSERT_GT(pid, 0);
    const std::string p = std::to_string(pid);
    ASSERT_EQ(Shell("heapdump arm --pid " + p + " --sample-bytes 64K").status, 0);
    EXPECT_TRUE(HasTables(pid));
    child->Send("exec");
    EXPECT_EQ(child->ReadLine(), "ready " + p);
    // Its threads allocate all the time: armed by the old request, it would have tables at once.
    usleep(500 * 1000);
    EXPECT_FALSE(HasTables(pid));
    hdtest::ShellOutput disarm = Shell("heapdump disarm --pid " + p);
    EXPECT_EQ(disarm.status, 4) << disarm.out;
    EXPECT_NE(disarm.out.find("was never armed"), std::string::npos) << disarm.out;
    hdtest::ShellOutput armed = Shell("heapdump arm --pid " + p);
    ASSERT_EQ(armed.status, 0) << armed.out;
    EXPECT_NE(armed.out.find("records every block"), std::string::npos) << armed.out;
    Command(child.get(), "keep 10 1234");
    EXPECT_EQ(SiteOf(Report(pid), "keep_after").blocks, 10);
    child->Send("exit");
    EXPECT_EQ(child->Finish(), 0);
  }
}

// Armed without --sample-bytes, a process records at the rate HEAPDUMP_SAMPLE_BYTES set in its
// environment (a service's drop-in may set it), else every block; --sample-bytes 0 asks for
// every block whatever the environment says.
TEST_F(Dormant, ArmedWithoutARateAProcessTakesItsEnvironmentsRate) {
  std::vector<std::unique_ptr<hdtest::Program>> children;
  struct Case {
    std::string env, arm, says;
  };
  for (const Case &c :
       {Case{"HEAPDUMP_SAMPLE_BYTES=64K", "", "records one block per 65536 bytes"},
        Case{"HEAPDUMP_SAMPLE_BYTES=64K", " --sample-bytes 0", "records every block"},
        Case{"HEAPDUMP_SAMPLE_BYTES=", "", "records every block"}}) {
    SCOPED_TRACE(c.env + c.arm);
    std::vector<std::string> env = hdtest::InstrumentedEnv(daemon.socket);
    env.push_back("HEAPDUMP_DORMANT=1");
    env.push_back(c.env);
    children.emplace_back(new hdtest::Program({HD_DORMANT_CHILD}, env));
    const std::string ready = children.back()->ReadLine();
    ASSERT_EQ(ready.rfind("ready ", 0), 0u) << ready;
    const std::string p = ready.substr(6);
    hdtest::ShellOutput armed = Shell("heapdump arm --pid " + p + c.arm);
    ASSERT_EQ(armed.status, 0) << armed.out;
    EXPECT_NE(armed.out.find(c.says), std::string::npos) << armed.out;
    // JSON says the rate only when sampled.
    const double rate = Field(Report(std::stoi(p)), "sample_bytes");
    if (c.says.find("65536") != std::string::npos) {
      EXPECT_EQ(rate, 65536.0);
    } else {
      EXPECT_LT(rate, 1.0);
    }
    // Its rate stays: another arming without one resumes at it, one with another is refused.
    if (c.arm.empty()) {
      EXPECT_EQ(Shell("heapdump arm --pid " + p).status, 0);
      hdtest::ShellOutput other = Shell("heapdump arm --pid " + p + " --sample-bytes 4K");
      EXPECT_EQ(other.status, 2) << other.out;
      EXPECT_NE(other.out.find("was armed at another --sample-bytes"), std::string::npos)
          << other.out;
    }
  }
  for (auto &child : children) {
    child->Send("exit");
    EXPECT_EQ(child->Finish(), 0);
  }
}

// A process that names no socket (as under /etc/ld.so.preload, which sets no variable) belongs to
// its user's default one, $XDG_RUNTIME_DIR/heapdump/collector.sock here: it makes that directory
// and the page, and the collector started later with no --socket arms it, through `heapdump arm`
// with none either.
TEST_F(Dormant, ANamelessSocketIsTheUsersDefaultOne) {
  const std::string xdg = dir + "/xdg";
  ASSERT_EQ(mkdir(xdg.c_str(), 0700), 0);
  hdtest::Program child(hdtest::Isolated{}, {HD_DORMANT_CHILD},
                        {std::string("LD_PRELOAD=") + HD_PRELOAD_LIB, "HEAPDUMP_DORMANT=1",
                         "XDG_RUNTIME_DIR=" + xdg});
  const std::string ready = child.ReadLine();
  ASSERT_EQ(ready.rfind("ready ", 0), 0u) << ready;
  const std::string p = ready.substr(6);
  struct stat st = {};
  ASSERT_EQ(stat((xdg + "/heapdump/collector.sock.arm").c_str(), &st), 0);
  hdtest::ShellOutput o = Shell("unset HEAPDUMP_SOCKET; export XDG_RUNTIME_DIR=" + xdg +
                                "\nheapdump-collector\n"
                                "trap 'heapdump-collector --stop' EXIT\n"
                                "if heapdump arm --pid " +
                                p + "; then echo arm=0; else echo arm=$?; fi\n");
  EXPECT_NE(o.out.find("arm=0"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("armed: process " + p + " (dormant_child) records every block"),
            std::string::npos)
      << o.out;
  child.Send("exit");
  EXPECT_EQ(child.Finish(), 0);
}

// python3 (Debian's) started dormant and armed sampled: what it allocates afterwards (20,000
// strings of 1,000-odd bytes, each a malloc of its own: pymalloc takes only blocks up to 512
// bytes) is estimated within four standard deviations of the truth; what it held before arming
// is unattributed.
TEST_F(Dormant, Python3ArmedSampledEstimatesWhatItAllocatesAfterwards) {
  if (!Installed("/usr/bin/python3")) GTEST_SKIP() << "python3 is not installed";
  std::vector<std::string> env = hdtest::InstrumentedEnv(daemon.socket);
  env.push_back("HEAPDUMP_DORMANT=1");
  hdtest::Program python({"/usr/bin/python3", "-c",
                          "import os, sys\n"
                          "print('ready', os.getpid(), flush=True)\n"
                          "for line in sys.stdin:\n"
                          "    if line.startswith('build'):\n"
                          "        kept = ['x' * 1000 + str(i) for i in range(20000)]\n"
                          "    print('ok', flush=True)\n"},
                         env);
  const std::string ready = python.ReadLine();
  ASSERT_EQ(ready.rfind("ready ", 0), 0u) << ready;
  const std::string p = ready.substr(6);
  // Armed first (each line it reads makes it allocate), then it builds the list.
  ASSERT_EQ(Shell("heapdump arm --pid " + p + " --sample-bytes 16K > arm.out 2>&1 &").status, 0);
  ASSERT_TRUE(hdtest::WaitUntil([&] {
    python.Send("poke");
    EXPECT_EQ(python.ReadLine(), "ok");
    return hdtest::ReadFile(dir + "/arm.out").find("records one block per 16384 bytes") !=
           std::string::npos;
  })) << hdtest::ReadFile(dir + "/arm.out");
  python.Send("build");
  ASSERT_EQ(python.ReadLine(), "ok");
  const std::string json = Report(std::stoi(p));
  const double live = Field(json, "live_bytes"), unattributed = Field(json, "unattributed_bytes");
  // 20,000 x (1,004 + the str object's 49) bytes, and the list's 160 KB: about 21.2 MB, and what
  // else python3 allocates meanwhile; at 16 KiB, one standard deviation is about
  // sqrt(21.2 MB x 16 KiB) = 0.6 MB.
  EXPECT_GT(live, 19.0e6) << json.substr(0, 1500);
  EXPECT_LT(live, 24.0e6) << json.substr(0, 1500);
  EXPECT_GT(unattributed, 0.0) << json.substr(0, 1500);
  EXPECT_EQ(Field(json, "sample_bytes"), 16384.0);
  EXPECT_EQ(python.Finish(), 0);
}

// A collector that finds an arm page of another layout (an older collector's) replaces the file
// rather than rewriting it: a process that mapped the old page reads it by the old layout, so it
// keeps that page, untouched, and is left unarmable; processes started since are armed.
TEST_F(Dormant, APageOfAnOlderLayoutIsReplacedNotRewritten) {
  if (!Installed("/usr/bin/python3")) GTEST_SKIP() << "python3 is not installed";
  hdtest::Collector later{dir + "/older"};
  ASSERT_EQ(mkdir(later.dir.c_str(), 0755), 0);
  const std::string run = later.socket.substr(0, later.socket.rfind('/'));
  ASSERT_EQ(mkdir(run.c_str(), 0700), 0);
  const std::string page = later.socket + ".arm";
  {
    std::string old(32768, '\0');
    const uint32_t head[2] = {0x6d726168, 2};  // "harm", version 2
    memcpy(&old[0], head, sizeof head);
    hdtest::WriteFile(page, old);
  }
  // The old page, mapped as a process of the older library maps it.
  hdtest::Program holder({"/usr/bin/python3", "-c",
                          "import mmap, os, sys\n"
                          "f = open(sys.argv[1], 'rb')\n"
                          "m = mmap.mmap(f.fileno(), 32768, prot=mmap.PROT_READ)\n"
                          "print(os.fstat(f.fileno()).st_ino, flush=True)\n"
                          "sys.stdin.readline()\n"
                          "print(m[:8].hex(), m[8:].count(0), flush=True)\n",
                          page},
                         {});
  const std::string old_inode = holder.ReadLine();
  later.Start();
  struct stat st = {};
  ASSERT_EQ(stat(page.c_str(), &st), 0);
  EXPECT_NE(std::to_string(st.st_ino), old_inode);
  EXPECT_EQ(st.st_size, 32768);
  std::unique_ptr<hdtest::Program> child;
  const pid_t pid = StartChild(&child, "1", {}, later.socket);
  ASSERT_GT(pid, 0);
  hdtest::ShellOutput armed =
      Shell("heapdump arm --socket " + later.socket + " --pid " + std::to_string(pid));
  EXPECT_EQ(armed.status, 0) << armed.out;
  // The old page as it was: its header, and nothing written after it.
  holder.Send("look");
  EXPECT_EQ(holder.ReadLine(), "6861726d02000000 " + std::to_string(32768 - 8));
  EXPECT_EQ(holder.Finish(), 0);
  child->Send("exit");
  EXPECT_EQ(child->Finish(), 0);
}

// Where the file system has no unnamed files, a creator of the arm page killed between making
// its named temporary and linking it leaves that file behind: the collector removes one that
// has not been written to for a minute when it starts, and leaves a younger one (its creator may
// be at work) and any other file alone.
TEST_F(Dormant, AHalfMadePageLeftByAKilledCreatorIsRemoved) {
  hdtest::Collector later{dir + "/leftover"};
  ASSERT_EQ(mkdir(later.dir.c_str(), 0755), 0);
  const std::string run = later.socket.substr(0, later.socket.rfind('/'));
  ASSERT_EQ(mkdir(run.c_str(), 0700), 0);
  const std::string old_one = run + "/.arm-page.4242.1000.5", young = run + "/.arm-page.4243.1.2",
                    other = run + "/.arm-page-notes";
  for (const std::string &f : {old_one, young, other}) hdtest::WriteFile(f, std::string(100, 'x'));
  hdtest::ShellOutput aged = Shell("touch -d '-2 minutes' " + old_one + " " + other);
  ASSERT_EQ(aged.status, 0) << aged.out;
  later.Start();
  EXPECT_NE(access(old_one.c_str(), F_OK), 0);
  EXPECT_EQ(access(young.c_str(), F_OK), 0);
  EXPECT_EQ(access(other.c_str(), F_OK), 0);
  EXPECT_EQ(access((later.socket + ".arm").c_str(), F_OK), 0);
  EXPECT_NE(later.Log().find("removed .arm-page.4242.1000.5, an arm page its creator left half "
                             "made"),
            std::string::npos)
      << later.Log();
}

// A process started before any collector ran on its socket (a service started at boot ahead of
// the collector's own unit, /run being empty after every boot): it makes the socket's directory,
// private, and the arm page, and the collector started later arms it through that very page.
TEST_F(Dormant, AProcessStartedBeforeAnyCollectorIsArmedByTheOneStartedLater) {
  hdtest::Collector later{dir + "/later"};
  ASSERT_EQ(mkdir(later.dir.c_str(), 0755), 0);
  std::unique_ptr<hdtest::Program> child;
  const pid_t pid = StartChild(&child, "1", {}, later.socket);
  ASSERT_GT(pid, 0);
  const std::string p = std::to_string(pid);
  struct stat st = {};
  const std::string run = later.socket.substr(0, later.socket.rfind('/'));
  ASSERT_EQ(stat(run.c_str(), &st), 0) << run;
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(stat((later.socket + ".arm").c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 32768);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  EXPECT_FALSE(HasTables(pid));
  later.Start();
  const std::string socket = " --socket " + later.socket;
  hdtest::ShellOutput armed = Shell("heapdump arm" + socket + " --pid " + p);
  ASSERT_EQ(armed.status, 0) << armed.out << later.Log();
  EXPECT_NE(armed.out.find("records every block"), std::string::npos) << armed.out;
  Command(child.get(), "keep 10 1234");
  hdtest::ShellOutput report =
      Shell("heapdump snapshot" + socket + " --pid " + p + " -o later.heapdump >/dev/null\n" +
            "heapdump report later.heapdump --json --top 0\n");
  ASSERT_EQ(report.status, 0) << report.out;
  EXPECT_EQ(SiteOf(report.out, "keep_after").blocks, 10) << report.out.substr(0, 800);
  child->Send("exit");
  EXPECT_EQ(child->Finish(), 0);
}

// Where a dormant process makes the page itself, and where it does not: a directory of its
// own, private even under a umask of 0277 (as the collector then wants it); never through a
// symbolic link another user could have put in its place; never relative to wherever it runs.
TEST_F(Dormant, AProcessMakesThePageOnlyInAPrivateDirectoryOfItsOwn) {
  const std::string run =
      "env LD_PRELOAD=" + std::string(HD_PRELOAD_LIB) + " HEAPDUMP_DORMANT=1 HEAPDUMP_SOCKET=";
  hdtest::ShellOutput o = Shell(
      "mkdir target && ln -s target link && mkdir cwd\n"
      "(umask 0277 && " +
      run + dir + "/umask/collector.sock ls >/dev/null)\n" + run + dir +
      "/link/collector.sock ls >/dev/null\n" + "cd cwd && " + run +
      "relative/collector.sock ls >/dev/null\n");
  ASSERT_EQ(o.status, 0) << o.out;
  struct stat st = {};
  ASSERT_EQ(stat((dir + "/umask").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(stat((dir + "/umask/collector.sock.arm").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  EXPECT_FALSE(hdtest::Exists(dir + "/target/collector.sock.arm"));
  EXPECT_FALSE(hdtest::Exists(dir + "/cwd/relative"));
  // The collector takes such a directory as its own.
  hdtest::Collector later{dir + "/umask-collector"};
  later.socket = dir + "/umask/collector.sock";
  later.Start();
}

// Where the file system has no unnamed temporary files (a container's overlayfs before Linux
// 6.6, NFS): the page is made under a name of its own, filled, linked to its name and the first
// name removed; the collector started later arms the process through it.
TEST_F(Dormant, WithoutUnnamedFilesThePageIsStillMadeWhole) {
  hdtest::Collector later{dir + "/later"};
  ASSERT_EQ(mkdir(later.dir.c_str(), 0755), 0);
  std::vector<std::string> env = {std::string("LD_PRELOAD=") + HD_NO_TMPFILE + ":" + HD_PRELOAD_LIB,
                                  "HEAPDUMP_SOCKET=" + later.socket, "HEAPDUMP_DORMANT=1"};
  hdtest::Program child({HD_DORMANT_CHILD}, env);
  const std::string ready = child.ReadLine();
  ASSERT_EQ(ready.rfind("ready ", 0), 0u) << ready;
  const std::string p = ready.substr(6);
  struct stat st = {};
  ASSERT_EQ(stat((later.socket + ".arm").c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 32768);
  EXPECT_EQ(st.st_nlink, 1u);  // the first name is gone
  const std::string run = later.socket.substr(0, later.socket.rfind('/'));
  EXPECT_EQ(hdtest::Glob(run, ".arm-page").size(), 0u);
  later.Start();
  hdtest::ShellOutput armed = Shell("heapdump arm --socket " + later.socket + " --pid " + p);
  ASSERT_EQ(armed.status, 0) << armed.out << later.Log();
  Command(&child, "keep 10 1234");
  hdtest::ShellOutput report =
      Shell("heapdump snapshot --socket " + later.socket + " --pid " + p +
            " -o later.heapdump >/dev/null\n" + "heapdump report later.heapdump --json --top 0\n");
  ASSERT_EQ(report.status, 0) << report.out;
  EXPECT_EQ(SiteOf(report.out, "keep_after").blocks, 10) << report.out.substr(0, 800);
  child.Send("exit");
  EXPECT_EQ(child.Finish(), 0);
}

// --trigger-live-bytes on an armed process: what it held before arming, which no site is credited
// with, counts toward the threshold as it counts toward a memory limit. The snapshot the trigger
// stored outlives the process, killed at once (as by the out-of-memory killer).
TEST_F(Dormant, ATriggerCountsWhatAnArmedProcessHeldBeforeArming) {
  hdtest::Collector watched{dir + "/watched"};
  watched.args = {"--sample-interval", "20", "--trigger-live-bytes", "8000000"};
  watched.Start();
  std::unique_ptr<hdtest::Program> child;
  const pid_t pid = StartChild(&child, "1", {}, watched.socket);
  ASSERT_GT(pid, 0);
  const std::string p = std::to_string(pid);
  const std::string socket = " --socket " + watched.socket;
  // Paused first, so that what the threads hold stays from before arming; the arming happens at
  // the next allocation, the main thread's.
  Command(child.get(), "pause");
  ASSERT_EQ(Shell("heapdump arm" + socket + " --pid " + p + " > arm.out 2>&1 &").status, 0);
  ASSERT_TRUE(hdtest::WaitUntil([&] {
    Command(child.get(), "keep 1 16");  // an allocation, at which the request, once made, is taken
    return hdtest::ReadFile(dir + "/arm.out").find("armed: process") != std::string::npos;
  })) << hdtest::ReadFile(dir + "/arm.out");
  // Held before arming: hold_before's 1,000,000 bytes and what the threads hold, under 8 MB
  // (at most 1 MB and 4 x 512 blocks of 3,000 bytes).
  usleep(300 * 1000);
  EXPECT_EQ(Shell("heapdump list" + socket).out.find("over-threshold"), std::string::npos);
  // 7.5 MB recorded, under the threshold on its own; with what came before, over it.
  Command(child.get(), "keep 7500 1000");
  const hdtest::ShellOutput listed =
      Shell("for i in $(seq 100); do heapdump list" + socket +
            " > list.txt; grep -q over-threshold list.txt && break; sleep 0.1; done\n"
            "kill -9 " +
            p + "\ngrep over-threshold list.txt | cut -d' ' -f1");
  child->Finish();
  ASSERT_NE(listed.out, "") << watched.Log();
  const std::string id = listed.out.substr(0, listed.out.find('\n'));
  const hdtest::ShellOutput report =
      Shell("heapdump download" + socket + " " + id + " -o trigger.heapdump >/dev/null\n" +
            "heapdump report trigger.heapdump --json --top 0\n");
  ASSERT_EQ(report.status, 0) << report.out;
  EXPECT_GT(SiteOf(report.out, "keep_after").blocks, 0) << report.out.substr(0, 800);
  const double recorded = Field(report.out, "live_bytes");
  EXPECT_LT(recorded, 8000000.0) << report.out.substr(0, 800);
  EXPECT_GE(recorded + Field(report.out, "unattributed_bytes"), 8000000.0)
      << report.out.substr(0, 800);
}

// Set-user-ID programs (in a fleet, su or passwd loaded by /etc/ld.so.preload) take nothing
// from the environment their caller chose. One root runs as nobody: HEAPDUMP_DORMANT=0 does not
// make it record. One nobody runs as root: dormant, it maps no page of its caller's collector
// (which would let that collector arm it and have it register), so `heapdump arm` is refused.
// (Every other process here loads the library too, from /etc/ld.so.preload: as themselves.)
TEST_F(Dormant, SetUserIdProgramsOnlyForward) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (chown, runuser, a mount namespace)";
  const std::string why = CannotOverlayEtc();
  if (!why.empty()) GTEST_SKIP() << "no mount namespace with an overlay on /etc here: " << why;
  ASSERT_EQ(chmod(dir.c_str(), 0711), 0);  // nobody reaches its collector and programs here
  ASSERT_EQ(Shell("mkdir nobody && chown 65534:65534 nobody\n"
                  "cp " +
                  std::string(HD_DORMANT_CHILD) + " as_nobody && chown 65534 as_nobody " +
                  "&& chmod 4755 as_nobody\n"
                  "cp " +
                  std::string(HD_DORMANT_CHILD) + " as_root && chown 0 as_root && " +
                  "chmod 4755 as_root\n")
                .status,
            0);
  hdtest::Collector nobody{dir + "/nobody"};
  nobody.uid = 65534;
  nobody.gid = 65534;
  nobody.Start();
  const std::string preload = EtcLdSoPreloadThenExec();
  struct Case {
    std::string command, socket, uids;
  };
  const Case cases[] = {
      {"env HEAPDUMP_DORMANT=0 " + dir + "/as_nobody", daemon.socket, "0\t65534\t"},
      {"runuser -u nobody -- " + dir + "/as_root", nobody.socket, "65534\t0\t"},
  };
  for (const Case &c : cases) {
    SCOPED_TRACE(c.command + " with " + c.socket);
    hdtest::Program child(
        {"/usr/bin/unshare", "-m", "--propagation", "private", "sh", "-c", preload + c.command},
        {"HEAPDUMP_SOCKET=" + c.socket});
    const std::string ready = child.ReadLine();
    ASSERT_EQ(ready.rfind("ready ", 0), 0u) << ready;
    const std::string p = ready.substr(6);
    const std::string status = hdtest::ReadFile("/proc/" + p + "/status");
    if (status.find("\nUid:\t" + c.uids) == std::string::npos) {
      child.Send("exit");
      child.Finish();
      GTEST_SKIP() << "set-user-ID bits not honoured here (a nosuid mount?):\n" << status;
    }
    const std::string maps = hdtest::ReadFile("/proc/" + p + "/maps");
    EXPECT_NE(maps.find("libheapdump.so"), std::string::npos);
    EXPECT_EQ(maps.find(".arm"), std::string::npos) << maps;
    Command(&child, "keep 10 1234");
    EXPECT_FALSE(HasTables(std::stoi(p)));
    hdtest::ShellOutput armed =
        Shell("heapdump arm --timeout 2 --socket " + c.socket + " --pid " + p);
    EXPECT_NE(armed.status, 0) << armed.out;
    EXPECT_FALSE(HasTables(std::stoi(p)));
    child.Send("exit");
    EXPECT_EQ(child.Finish(), 0);
  }
}

// docs/tools.md's service set-up as written, short of systemd itself (no service manager runs
// in the tests): /run is this test's directory, my-user the test's user, the library this
// build's; the drop-in's Environment= lines, split on blanks as systemd splits them, are the
// service's whole environment, and starting the busy program with them stands for the line that
// restarts the service (its pid for the one that shows it, and for 4242). The service, started
// before the collector as the doc orders them, makes the arm page the collector then uses: it is
// dormant, armed by the doc's own line, and records.
TEST_F(Dormant, DocsServiceSetUpRunsAsWritten) {
  if (geteuid() != 0) GTEST_SKIP() << "the doc's lines are root's (install -o, runuser)";
  const std::string doc = hdtest::ReadFile(std::string(HD_SOURCE_DIR) + "/docs/tools.md");
  const size_t start = doc.find("- **A service:** a systemd drop-in");
  ASSERT_NE(start, std::string::npos);
  std::istringstream section(doc.substr(start, doc.find("\n- **", start + 1) - start));
  const struct passwd *pw = getpwuid(getuid());
  ASSERT_NE(pw, nullptr);
  const std::string user = pw->pw_name;
  auto here = [&](std::string s) {
    s = std::regex_replace(s, std::regex("/usr/local/lib/heapdump/libheapdump.so"), HD_PRELOAD_LIB);
    s = std::regex_replace(s, std::regex(" /run/"), " " + dir + "/run/");
    s = std::regex_replace(s, std::regex("=/run/"), "=" + dir + "/run/");
    s = std::regex_replace(s, std::regex(" /var/lib/"), " " + dir + "/var/lib/");
    return std::regex_replace(s, std::regex("my-user"), user);
  };
  std::string service_env = "env -i PATH=/usr/bin:/bin";
  // An administrator's PATH (install and runuser are in sbin).
  std::string script = "set -e\nPATH=$PATH:/usr/sbin:/sbin\nmkdir -p run\nmkfifo server.in\n";
  int lines = 0;
  for (std::string line; std::getline(section, line);) {
    if (line.rfind("      ", 0) != 0) continue;
    line = line.substr(6);
    if (line.rfind("Environment=", 0) == 0) {
      // Nothing in it that systemd would unquote or expand.
      ASSERT_EQ(line.find_first_of("\"'\\$%"), std::string::npos) << line;
      service_env += " " + here(line.substr(12));
      lines++;
    } else if (line.rfind("install -d ", 0) == 0) {
      script += here(line) + "\n";
      lines++;
    } else if (line.rfind("runuser ", 0) == 0) {
      // runuser resets PATH as su does: the collector where this build has it, not installed.
      // A HOME nothing can be made in, as a service account's may be (/nonexistent, which root
      // could make): the doc's line must not need one.
      script +=
          std::regex_replace(here(line), std::regex("-- heapdump-collector "),
                             "-- env HOME=/proc/nonexistent " + std::string(HD_COLLECTOR) + " ") +
          "\n";
      script += "trap 'heapdump-collector --stop --socket " +
                here(" " + line.substr(line.find("/run/"))).substr(1) + " >/dev/null' EXIT\n";
      lines++;
    } else if (line.rfind("systemctl daemon-reload && systemctl restart my-server", 0) == 0) {
      script += service_env + " " + HD_DORMANT_CHILD + " < server.in > server.out 2>&1 &\n" +
                "exec 4> server.in\n" +
                "for i in $(seq 100); do grep -q ready server.out && break; sleep 0.1; done\n" +
                "pid=$(sed -n 's/^ready //p' server.out)\n";
      lines++;
    } else if (line.rfind("systemctl show -p MainPID --value my-server", 0) == 0) {
      script += "echo $pid\n";
      lines++;
    } else if (line.rfind("heapdump arm ", 0) == 0) {
      script += std::regex_replace(here(line), std::regex("4242"), "$pid") + "\n";
      lines++;
    }
  }
  ASSERT_EQ(lines, 8) << script;
  const std::string sock = dir + "/run/my-server/heapdump/collector.sock";
  script +=
      "echo keep 20000 1234 >&4\n"
      "for i in $(seq 100); do grep -q '^ok' server.out && break; sleep 0.1; done\n"
      "heapdump snapshot --socket " +
      sock +
      " --pid $pid -o service.heapdump\n"
      "heapdump report service.heapdump --json --top 0\n"
      "echo exit >&4\nexec 4>&-\nwait\n";
  hdtest::ShellOutput o = Shell(script);
  ASSERT_EQ(o.status, 0) << script << o.out;
  EXPECT_TRUE(std::regex_search(
      o.out,
      std::regex("armed: process [0-9]+ \\(dormant_child\\) records one block per 524288 bytes")))
      << o.out;
  // Sampled at 512 KiB, the 24.7 MB kept are about 47 recorded blocks, each standing for about
  // 425: an estimate of 20,000 whose standard deviation is about 15%.
  const double kept = SiteOf(o.out.substr(o.out.find('{')), "keep_after").blocks;
  EXPECT_GT(kept, 10000) << o.out;
  EXPECT_LT(kept, 40000) << o.out;
  // The doc's collector served all of it, stored where the doc says, and was stopped at the end
  // (its pid file gone).
  EXPECT_NE(access((dir + "/run/my-server/heapdump/collector.sock.arm").c_str(), F_OK), -1);
  EXPECT_NE(access((dir + "/var/lib/my-server/heapdump").c_str(), W_OK), -1);
  EXPECT_EQ(access((dir + "/run/my-server/heapdump/collector.pid").c_str(), F_OK), -1);
}

// Loaded by /etc/ld.so.preload (in a mount namespace of the test's own, where /etc is an overlay
// holding that file), without LD_PRELOAD: the library is in the process, dormant, and armable.
TEST_F(Dormant, LoadedFromEtcLdSoPreloadItIsDormantUntilArmed) {
  const std::string why = CannotOverlayEtc();
  if (!why.empty()) GTEST_SKIP() << "no mount namespace with an overlay on /etc here: " << why;
  std::unique_ptr<hdtest::Program> child;
  const pid_t pid = StartFromEtcLdSoPreload(&child);
  ASSERT_GT(pid, 0);
  EXPECT_FALSE(HasTables(pid));
  hdtest::ShellOutput armed = Shell("heapdump arm --pid " + std::to_string(pid));
  ASSERT_EQ(armed.status, 0) << armed.out;
  Command(child.get(), "keep 10 1234");
  EXPECT_EQ(SiteOf(Report(pid), "keep_after").blocks, 10);
  child->Send("exit");
  EXPECT_EQ(child->Finish(), 0);
}

// The library reads /etc/ld.so.preload 512 bytes at a time: its name cut by the end of a read
// is still found (else the process would record from the start, with tables).
TEST_F(Dormant, LoadedFromEtcLdSoPreloadNamedAcrossAReadItIsDormant) {
  const std::string why = CannotOverlayEtc();
  if (!why.empty()) GTEST_SKIP() << "no mount namespace with an overlay on /etc here: " << why;
  const size_t at = std::string(HD_PRELOAD_LIB).find("libheapdump");
  ASSERT_LT(at, 500u) << HD_PRELOAD_LIB;
  std::unique_ptr<hdtest::Program> child;
  const pid_t pid = StartFromEtcLdSoPreload(&child, 512 - 5 - at);
  ASSERT_GT(pid, 0);
  Command(child.get(), "keep 10 1234");
  EXPECT_FALSE(HasTables(pid));
  hdtest::ShellOutput armed = Shell("heapdump arm --pid " + std::to_string(pid));
  ASSERT_EQ(armed.status, 0) << armed.out;
  child->Send("exit");
  EXPECT_EQ(child->Finish(), 0);
}

// docs/tools.md's "Arming a running process" lines as written: the busy program as my-server,
// started by the doc's own line (the library's path made this build's), its pid for 4242.
TEST_F(Dormant, DocsArmingRunsAsWritten) {
  const std::string doc = hdtest::ReadFile(std::string(HD_SOURCE_DIR) + "/docs/tools.md");
  const size_t start = doc.find("#### Arming a running process");
  ASSERT_NE(start, std::string::npos);
  std::istringstream section(doc.substr(start, doc.find("\n#", start + 1) - start));
  std::string script = "cp " + std::string(HD_DORMANT_CHILD) + " my-server\nmkfifo server.in\n";
  int commands = 0;
  for (std::string line; std::getline(section, line);) {
    if (line.rfind("    HEAPDUMP_DORMANT=1 LD_PRELOAD=", 0) == 0) {
      line = std::regex_replace(
          line.substr(4), std::regex("/usr/local/lib/heapdump/libheapdump.so"), HD_PRELOAD_LIB);
      ASSERT_EQ(line.substr(line.size() - 13), "./my-server &") << line;
      script += line.substr(0, line.size() - 1) + "< server.in > server.out 2>&1 &\n" +
                "exec 4> server.in\n"  // it runs until this closes
                "for i in $(seq 100); do grep -q ready server.out && break; sleep 0.1; done\n" +
                "pid=$(sed -n 's/^ready //p' server.out)\n";
      commands++;
    } else if (line.rfind("    heapdump ", 0) == 0) {
      script += std::regex_replace(line.substr(4), std::regex("4242"), "$pid") + "\n";
      commands++;
    }
  }
  ASSERT_EQ(commands, 5) << script;
  script += "echo exit >&4\nexec 4>&-\nwait\ncat server.out\n";
  hdtest::ShellOutput o = Shell(script);
  ASSERT_EQ(o.status, 0) << script << o.out;
  EXPECT_TRUE(std::regex_search(
      o.out,
      std::regex("armed: process [0-9]+ \\(my-server\\) records one block per 524288 bytes")))
      << o.out;
  EXPECT_NE(o.out.find("sampled: one block recorded per 524288 bytes"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("armed: the blocks allocated since the process was armed are recorded"),
            std::string::npos)
      << o.out;
  // The recorded live bytes and those from before arming make the process's whole.
  std::smatch totals, armed;
  ASSERT_TRUE(std::regex_search(o.out, totals,
                                std::regex("my-server\\[[0-9]+\\]: [0-9]+ live "
                                           "blocks, ([0-9]+) live bytes")))
      << o.out;
  ASSERT_TRUE(std::regex_search(
      o.out, armed, std::regex("; ([0-9]+) more live bytes, .*: ([0-9]+) live bytes in all")))
      << o.out;
  EXPECT_EQ(std::stoull(totals[1]) + std::stoull(armed[1]), std::stoull(armed[2])) << o.out;
  EXPECT_TRUE(std::regex_search(o.out, std::regex("disarmed: process [0-9]+ \\(my-server\\)")))
      << o.out;
  EXPECT_TRUE(std::regex_search(o.out, std::regex("done, [0-9]+ signals handled"))) << o.out;
  // The HTML page of the armed snapshot says so, above its recording statistics.
  ASSERT_EQ(Shell("heapdump report armed.heapdump --format html -o armed.html").status, 0);
  std::string why;
  auto browser = hdtest::Browser::Launch(&why);
  ASSERT_NE(browser, nullptr) << why;
  ASSERT_TRUE(browser->Open(dir + "/armed.html")) << browser->error();
  ASSERT_TRUE(browser->WaitFor("document.body.dataset.ready === '1'")) << browser->error();
  const auto note = browser->EvalString("document.getElementById('armed-note').textContent");
  ASSERT_TRUE(note.has_value()) << browser->error();
  EXPECT_NE(note->find("Armed: the blocks allocated since the process was armed are recorded"),
            std::string::npos)
      << *note;
  EXPECT_NE(note->find("more live bytes, allocated before, are attributed to no site"),
            std::string::npos)
      << *note;
}

// redis-server (Debian's) started dormant, under redis-benchmark's load on 127.0.0.1 (bounded:
// at most 2,000,000 requests, stopped once the rounds are done): armed, snapshot, disarmed, three
// times over while the load runs, then armed and snapshot once more; redis answers throughout,
// the snapshots show redis's own sites, and it shuts down cleanly.
TEST_F(Dormant, RedisUnderLoadIsArmedAndDisarmedSafely) {
  if (!Installed("/usr/bin/redis-server") || !Installed("/usr/bin/redis-benchmark")) {
    GTEST_SKIP() << "redis-server or redis-benchmark is not installed";
  }
  const std::string port = std::to_string(hdtest::FreePort());
  const std::string cli = "redis-cli -p " + port;
  hdtest::ShellOutput o =
      Shell("HEAPDUMP_DORMANT=1 LD_PRELOAD=" + std::string(HD_PRELOAD_LIB) +
            " redis-server --port " + port +
            " --bind 127.0.0.1 --save '' --appendonly no > redis.log 2>&1 &\n"
            "redis=$!\n"
            "for i in $(seq 200); do " +
            cli +
            " ping 2>/dev/null | grep -q PONG && break; sleep 0.05; done\n"
            "redis-benchmark -p " +
            port +
            " -n 2000000 -c 8 -r 20000 -t set,get,lpush,hset -q > bench.out 2>&1 &\n"
            "bench=$!\n"
            "trap 'kill $bench $redis 2>/dev/null || true' EXIT\n"
            "step() { name=$1; shift; if \"$@\"; then echo $name=0; else echo $name=$?; fi; }\n"
            "for round in 1 2 3; do\n"
            "  sleep 0.3\n"
            "  kill -0 $bench && echo load$round=running\n"
            "  step arm$round heapdump arm --pid $redis\n"
            "  step snapshot$round heapdump snapshot --pid $redis -o armed$round.heapdump\n"
            "  step disarm$round heapdump disarm --pid $redis\n"
            "  heapdump report armed$round.heapdump --top 3 > report$round.txt && "
            "echo report$round=0\n"
            "  grep -Eq 'zmalloc|createObject|dictAdd|sdsnewlen' report$round.txt && "
            "echo sites$round=redis\n"
            "  " +
            cli +
            " ping\n"
            "done\n"
            "step arm-last heapdump arm --pid $redis\n"
            "kill -0 $bench && echo load-last=running\n"
            "step snapshot-last heapdump snapshot --pid $redis -o last.heapdump\n"
            "kill $bench; wait $bench || true\n"
            "heapdump report last.heapdump --top 5 | head -40\n" +
            cli + " dbsize\n" + cli +
            " shutdown nosave > /dev/null 2>&1 || true\n"
            "wait $redis; echo redis-status=$?\n");
  ASSERT_EQ(o.status, 0) << o.out;
  EXPECT_NE(o.out.find("redis-status=0"), std::string::npos) << o.out;
  for (const char *step : {"arm-last=0", "load-last=running", "snapshot-last=0"})
    EXPECT_NE(o.out.find(step), std::string::npos) << step << "\n" << o.out;
  EXPECT_EQ(std::regex_search(o.out, std::regex("armed: process [0-9]+ \\(redis-server\\)")), true)
      << o.out;
  size_t pongs = 0;
  for (size_t at = o.out.find("PONG"); at != std::string::npos; at = o.out.find("PONG", at + 1))
    pongs++;
  EXPECT_EQ(pongs, 3u) << o.out;
  // Each round: armed and disarmed while the benchmark ran, its snapshot read, redis's sites in it.
  for (const std::string &round : std::vector<std::string>{"1", "2", "3"}) {
    for (const std::string &step : std::vector<std::string>{
             "load" + round + "=running", "arm" + round + "=0", "snapshot" + round + "=0",
             "disarm" + round + "=0", "report" + round + "=0", "sites" + round + "=redis"}) {
      EXPECT_NE(o.out.find(step), std::string::npos) << step << "\n" << o.out;
    }
  }
  size_t disarmed = 0;
  for (size_t at = o.out.find("disarmed: process"); at != std::string::npos;
       at = o.out.find("disarmed: process", at + 1))
    disarmed++;
  EXPECT_EQ(disarmed, 3u) << o.out;
  // The keys redis holds were stored while it recorded: its own sites show.
  EXPECT_TRUE(std::regex_search(o.out, std::regex("zmalloc|createObject|dictAdd|sdsnewlen")))
      << o.out;
  EXPECT_NE(o.out.find("armed: the blocks allocated since the process was armed are recorded"),
            std::string::npos)
      << o.out;
}

}  // namespace
