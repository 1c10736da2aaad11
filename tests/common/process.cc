#include "process.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>

#include "listener.h"

namespace hdtest {

std::string TempDir(const std::string &prefix) {
  std::string path = "/tmp/hd-" + prefix + "-XXXXXX";
  return mkdtemp(&path[0]) != nullptr ? path : "";
}

RemoveWhenPassed::~RemoveWhenPassed() {
  if (::testing::Test::HasFailure()) {
    fprintf(stderr, "kept %s\n", path.c_str());
    return;
  }
  auto remove_one = [](const char *file, const struct stat *, int, struct FTW *) {
    return remove(file);
  };
  nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
}

bool WaitUntil(const std::function<bool()> &pred, double seconds) {
  for (int i = 0; i < seconds * 50; i++) {
    if (pred()) return true;
    usleep(20000);
  }
  return pred();
}

std::string ReadFile(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool Exists(const std::string &path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

std::vector<std::string> Lines(const std::string &text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::vector<std::string> Glob(const std::string &dir, const std::string &prefix) {
  std::vector<std::string> out;
  DIR *d = opendir(dir.c_str());
  while (dirent *e = d ? readdir(d) : nullptr) {
    if (std::string(e->d_name).rfind(prefix, 0) == 0) out.push_back(e->d_name);
  }
  if (d) closedir(d);
  return out;
}

void WriteFile(const std::string &path, const std::string &bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

bool BecomeUser(uid_t uid, gid_t gid) {
  return setgroups(0, nullptr) == 0 && setgid(gid) == 0 && setuid(uid) == 0;
}

namespace {

// In a forked child, after any change of user (which clears it): if the test dies before it
// stops the child (a crash, a sanitizer report), the child must not outlive it, holding the
// test's output pipes open.
void DieWithTheTest() { prctl(PR_SET_PDEATHSIG, SIGKILL); }

std::vector<char *> CStrings(const std::vector<std::string> &strings) {
  std::vector<char *> out;
  for (const std::string &s : strings) out.push_back(const_cast<char *>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

}  // namespace

Collector::Collector(const std::string &base) : dir(base) {
  socket = dir + "/run/collector.sock";
  storage = dir + "/state";
  log = dir + "/collector.log";
}

// A clean stop, checked: in the sanitizer build LeakSanitizer then checks the daemon for leaks.
Collector::~Collector() { Stop(SIGTERM); }

bool DetachedCollectors() {
  const char *mode = getenv("HD_TEST_COLLECTOR_MODE");
  return mode != nullptr && strcmp(mode, "detached") == 0;
}

void Collector::Start() {
  bool detached = DetachedCollectors();
  std::vector<std::string> argv = {HD_COLLECTOR, "--socket",    socket, "--storage",
                                   storage,      "--log-level", "debug"};
  if (detached) {
    // As a user starts it: it forks, the daemon outlives the starter. As the daemon's subreaper
    // this test still reaps it, and sees its exit status.
    prctl(PR_SET_CHILD_SUBREAPER, 1);
    argv.insert(argv.end(), {"--log-file", log});
  } else {
    argv.insert(argv.begin() + 1, "--foreground");
  }
  argv.insert(argv.end(), args.begin(), args.end());
  pid_t starter = fork();
  if (starter == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) dup2(fd, 2);
    if (fd >= 0 && detached) dup2(fd, 1);
    // A detached daemon opens the log itself (--log-file), as the user it runs as.
    if (fd >= 0 && uid != kSameUser && fchown(fd, uid, gid) != 0) _exit(125);
    for (const std::string &e : env) putenv(const_cast<char *>(e.c_str()));
    if (uid != kSameUser && !BecomeUser(uid, gid)) _exit(126);
    DieWithTheTest();
    execv(HD_COLLECTOR, CStrings(argv).data());
    _exit(127);
  }
  pid = starter;
  if (detached) {
    int status = 0;
    waitpid(starter, &status, 0);
    pid = -1;
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "detaching collector status " << status << ":\n"
        << Log();
    std::string pid_file = socket.substr(0, socket.size() - 5) + ".pid";
    pid = atoi(ReadFile(pid_file).c_str());
    ASSERT_GT(pid, 0) << "no pid in " << pid_file << ":\n" << Log();
    ASSERT_NE(Log().find("heapdump-collector: pid " + std::to_string(pid) + ", listening on"),
              std::string::npos)
        << Log();
  }
  bool listening = WaitForListener(socket, pid);
  if (!listening) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
  ASSERT_TRUE(listening) << "collector did not start:\n" << Log();
}

void Collector::Stop(int sig) {
  if (pid <= 0) return;
  kill(pid, sig);
  int status = 0;
  waitpid(pid, &status, 0);
  if (sig == SIGTERM) {
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "collector status " << status << ":\n"
        << Log();
  }
  pid = -1;
}

size_t Settled(const std::function<size_t()> &count) {
  size_t settled = count();
  for (int same = 0, i = 0; same < 10 && i < 500; i++) {
    usleep(50000);
    const size_t now = count();
    same = now == settled ? same + 1 : 0;
    settled = now;
  }
  return settled;
}

size_t Collector::SettledFdCount() const {
  return Settled([this] { return Fds().size(); });
}

size_t Collector::PeakRssKb() const {
  std::string status = ReadFile("/proc/" + std::to_string(pid) + "/status");
  size_t at = status.find("VmHWM:");
  return at == std::string::npos ? 0 : std::stoul(status.substr(at + 6));
}

void Collector::ResetPeakRss() const {
  std::ofstream("/proc/" + std::to_string(pid) + "/clear_refs") << "5";  // 5: reset VmHWM
}

std::vector<std::string> Collector::Fds() const {
  std::string path = "/proc/" + std::to_string(pid) + "/fd";
  std::vector<std::string> fds;
  if (DIR *d = opendir(path.c_str())) {
    while (struct dirent *e = readdir(d)) {
      if (e->d_name[0] == '.') continue;
      char target[256];
      ssize_t n = readlink((path + "/" + e->d_name).c_str(), target, sizeof target - 1);
      size_t length = n > 0 ? static_cast<size_t>(n) : 0;
      fds.push_back(std::string(e->d_name) + " -> " + std::string(target, length));
    }
    closedir(d);
  }
  return fds;
}

// Makes the next fork likely to get pid: the kernel hands out ns_last_pid + 1 next.
static bool AimNextPid(pid_t pid) {
  int fd = open("/proc/sys/kernel/ns_last_pid", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::string text = std::to_string(pid - 1);
  bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  return ok;
}

Program::Program(const std::vector<std::string> &argv, const std::vector<std::string> &env,
                 uid_t uid, gid_t gid, pid_t want_pid) {
  Start(argv, env, false, uid, gid, want_pid);
}

Program::Program(Isolated, const std::vector<std::string> &argv,
                 const std::vector<std::string> &env) {
  Start(argv, env, true, kSameUser, 0, 0);
}

void Program::Start(const std::vector<std::string> &argv, const std::vector<std::string> &env,
                    bool isolated, uid_t uid, gid_t gid, pid_t want_pid) {
  // Built before fork: in a child of a threaded test, malloc could wait forever on a lock.
  std::vector<char *> args = CStrings(argv), envp = CStrings(env);
  int to_child[2], from_child[2];
  EXPECT_EQ(pipe2(to_child, O_CLOEXEC), 0);
  EXPECT_EQ(pipe2(from_child, O_CLOEXEC), 0);
  for (int attempt = 0; attempt < 1000; attempt++) {
    if (want_pid != 0 && !AimNextPid(want_pid)) break;
    pid = fork();
    if (pid == 0) {
      if (want_pid != 0 && getpid() != want_pid) _exit(0);
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      if (isolated) syscall(SYS_close_range, 3, ~0U, 0);
      if (!isolated) {
        for (const std::string &e : env) putenv(const_cast<char *>(e.c_str()));
      }
      if (uid != kSameUser && !BecomeUser(uid, gid)) _exit(126);
      DieWithTheTest();
      if (isolated) {
        execve(args[0], args.data(), envp.data());
      } else {
        execv(args[0], args.data());
      }
      _exit(127);
    }
    if (want_pid == 0 || pid == want_pid) break;
    waitpid(pid, nullptr, 0);  // another process took the pid first
    pid = -1;
  }
  close(to_child[0]);
  close(from_child[1]);
  in = to_child[1];
  out = fdopen(from_child[0], "r");
}

Program::~Program() {
  Kill();
  if (in >= 0) close(in);
  if (out != nullptr) fclose(out);
}

std::string Program::ReadLine() {
  char line[256];
  if (fgets(line, sizeof line, out) == nullptr) return "";
  line[strcspn(line, "\n")] = '\0';
  return line;
}

void Program::Send(const std::string &line) {
  std::string text = line + "\n";
  EXPECT_EQ(write(in, text.data(), text.size()), static_cast<ssize_t>(text.size()));
}

std::string Program::ReadThrough(const std::string &line) {
  std::string text;
  char *buf = nullptr;
  size_t size = 0;
  ssize_t n;
  while ((n = getline(&buf, &size, out)) > 0) {
    text.append(buf, static_cast<size_t>(n));
    if (std::string(buf, static_cast<size_t>(n)) == line + "\n") break;
  }
  free(buf);
  return text;
}

int Program::Finish(std::string *rest) {
  if (in >= 0) close(in);
  in = -1;
  char buf[4096];
  size_t n;
  while (rest != nullptr && (n = fread(buf, 1, sizeof buf, out)) > 0) rest->append(buf, n);
  int status = -1;
  if (pid > 0) waitpid(pid, &status, 0);
  pid = -1;
  return status;
}

void Program::Kill() {
  if (pid <= 0) return;
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  pid = -1;
}

int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  int port = -1;
  if (fd >= 0 && bind(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr *>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) close(fd);
  EXPECT_GT(port, 0) << "no free TCP port on 127.0.0.1";
  return port;
}

std::vector<std::string> InstrumentedEnv(const std::string &socket, bool exit_snapshot) {
  std::vector<std::string> env = {std::string("LD_PRELOAD=") + HD_PRELOAD_LIB,
                                  "HEAPDUMP_SOCKET=" + socket};
  if (exit_snapshot) env.push_back("HEAPDUMP_EXIT_SNAPSHOT=1");
  return env;
}

ShellOutput RunShell(const std::string &script, const std::string &cwd,
                     const std::vector<std::string> &env) {
  ShellOutput o;
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) return o;
  pid_t pid = fork();
  if (pid == 0) {
    dup2(pipefd[1], 1);
    dup2(pipefd[1], 2);
    if (chdir(cwd.c_str()) != 0) _exit(125);
    std::vector<std::string> envp = env;
    execle("/bin/bash", "bash", "-e", "-c", script.c_str(), (char *)nullptr, CStrings(envp).data());
    _exit(127);
  }
  close(pipefd[1]);
  char buf[4096];
  ssize_t n;
  while ((n = read(pipefd[0], buf, sizeof buf)) > 0) o.out.append(buf, static_cast<size_t>(n));
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  o.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return o;
}

}  // namespace hdtest
