#include "browser.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

extern char **environ;

namespace hdtest {

using Clock = std::chrono::steady_clock;

class Browser::Deadline {
 public:
  explicit Deadline(double seconds)
      : seconds_(seconds),
        end_(Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                std::chrono::duration<double>(std::max(seconds, 0.0)))) {}
  bool Passed() const { return Clock::now() >= end_; }
  double SecondsLeft() const {
    return std::max(std::chrono::duration<double>(end_ - Clock::now()).count(), 0.0);
  }
  // Rounded up, so that a poll() does not wake just before the end only to wait again.
  int MillisecondsLeft() const {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(end_ - Clock::now()).count();
    return static_cast<int>(std::clamp<decltype(left)>(left, 0, 24 * 3600 * 1000));
  }
  std::string Describe() const {
    char text[32];
    snprintf(text, sizeof text, "%g s", seconds_);
    return text;
  }

 private:
  double seconds_;
  Clock::time_point end_;
};

namespace cdp {

std::string JsonQuote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escape[8];
          snprintf(escape, sizeof escape, "\\u%04x", c);
          out += escape;
        } else {
          out += c;  // UTF-8 goes as it is: JSON texts are UTF-8
        }
    }
  }
  return out + "\"";
}

namespace {

// A reader of just enough JSON to find values by path in well-formed texts from the browser: it
// checks structure only as far as it walks.
class JsonReader {
 public:
  explicit JsonReader(std::string_view json) : json_(json) {}

  // Moves to the value at path from the start of the text.
  bool Find(const std::vector<std::string> &path) {
    at_ = 0;
    SkipSpace();
    for (const std::string &key : path) {
      if (!Enter(key)) return false;
    }
    return at_ < json_.size();
  }
  // The value there, as text.
  std::string_view Raw() {
    size_t start = at_;
    return SkipValue() ? json_.substr(start, at_ - start) : std::string_view();
  }
  // The string there, decoded.
  std::optional<std::string> String() {
    if (Peek() != '"') return std::nullopt;
    at_++;
    std::string out;
    while (at_ < json_.size()) {
      char c = json_[at_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= json_.size()) return std::nullopt;
      switch (char e = json_[at_++]) {
        case '"':
        case '\\':
        case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          std::optional<uint32_t> unit = Hex4();
          if (!unit) return std::nullopt;
          uint32_t code = *unit;
          // Characters beyond the 16-bit range come as a pair of surrogates, high then low.
          if (code >= 0xD800 && code < 0xDC00 && json_.substr(at_, 2) == "\\u") {
            size_t before_low = at_;
            at_ += 2;
            std::optional<uint32_t> low = Hex4();
            if (low && *low >= 0xDC00 && *low < 0xE000) {
              code = 0x10000 + ((code - 0xD800) << 10) + (*low - 0xDC00);
            } else {
              at_ = before_low;  // not a pair: the second escape stands alone
            }
          }
          if (code >= 0xD800 && code < 0xE000) code = 0xFFFD;  // a lone surrogate
          AppendUtf8(code, &out);
          break;
        }
        default: return std::nullopt;
      }
    }
    return std::nullopt;
  }

 private:
  char Peek() const { return at_ < json_.size() ? json_[at_] : '\0'; }
  void SkipSpace() {
    while (at_ < json_.size() && strchr(" \t\r\n", json_[at_]) != nullptr) at_++;
  }
  bool Expect(char c) {
    SkipSpace();
    if (Peek() != c) return false;
    at_++;
    SkipSpace();
    return true;
  }

  // From an object to its member key, or from an array to its element number key.
  bool Enter(const std::string &key) {
    char open = Peek();
    if (open != '{' && open != '[') return false;
    const char close = open == '{' ? '}' : ']';
    at_++;
    SkipSpace();
    for (size_t index = 0; Peek() != close; index++) {
      bool found;
      if (open == '{') {
        std::optional<std::string> name = String();
        if (!name || !Expect(':')) return false;
        found = *name == key;
      } else {
        found = key == std::to_string(index);
      }
      if (found) return true;
      if (!SkipValue()) return false;
      SkipSpace();
      if (Peek() == ',') {
        at_++;
        SkipSpace();
      } else if (Peek() != close) {
        return false;
      }
    }
    return false;
  }

  // Past the value here: brackets are counted rather than descended into, so depth costs no
  // stack.
  bool SkipValue() {
    if (Peek() == '"') return String().has_value();
    if (Peek() != '{' && Peek() != '[') {
      size_t start = at_;
      while (at_ < json_.size() && strchr(",}] \t\r\n", json_[at_]) == nullptr) at_++;
      return at_ > start;
    }
    int depth = 0;
    while (at_ < json_.size()) {
      char c = json_[at_];
      if (c == '"') {
        if (!String()) return false;
        continue;
      }
      at_++;
      if (c == '{' || c == '[') depth++;
      if ((c == '}' || c == ']') && --depth == 0) return true;
    }
    return false;
  }

  std::optional<uint32_t> Hex4() {
    if (at_ + 4 > json_.size()) return std::nullopt;
    uint32_t value = 0;
    for (int i = 0; i < 4; i++) {
      char c = json_[at_++];
      int digit = c >= '0' && c <= '9'   ? c - '0'
                  : c >= 'a' && c <= 'f' ? c - 'a' + 10
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                         : -1;
      if (digit < 0) return std::nullopt;
      value = value * 16 + static_cast<uint32_t>(digit);
    }
    return value;
  }

  static void AppendUtf8(uint32_t code, std::string *out) {
    auto byte = [out](uint32_t b) { *out += static_cast<char>(b); };
    if (code < 0x80) {
      byte(code);
    } else if (code < 0x800) {
      byte(0xC0 | code >> 6);
      byte(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      byte(0xE0 | code >> 12);
      byte(0x80 | (code >> 6 & 0x3F));
      byte(0x80 | (code & 0x3F));
    } else {
      byte(0xF0 | code >> 18);
      byte(0x80 | (code >> 12 & 0x3F));
      byte(0x80 | (code >> 6 & 0x3F));
      byte(0x80 | (code & 0x3F));
    }
  }

  std::string_view json_;
  size_t at_ = 0;
};

}  // namespace

std::optional<std::string> JsonString(std::string_view json, const std::vector<std::string> &path) {
  JsonReader reader(json);
  return reader.Find(path) ? reader.String() : std::nullopt;
}

std::optional<std::string> JsonRaw(std::string_view json, const std::vector<std::string> &path) {
  JsonReader reader(json);
  if (!reader.Find(path)) return std::nullopt;
  std::string_view raw = reader.Raw();
  if (raw.empty()) return std::nullopt;
  return std::string(raw);
}

std::optional<std::string> Base64Decode(std::string_view text) {
  auto sextet = [](char c) {
    return c >= 'A' && c <= 'Z'   ? c - 'A'
           : c >= 'a' && c <= 'z' ? c - 'a' + 26
           : c >= '0' && c <= '9' ? c - '0' + 52
           : c == '+'             ? 62
           : c == '/'             ? 63
                                  : -1;
  };
  while (!text.empty() && text.back() == '=') text.remove_suffix(1);
  if (text.size() % 4 == 1) return std::nullopt;  // 6 bits cannot end a byte
  std::string out;
  out.reserve(text.size() / 4 * 3 + 2);
  uint32_t bits = 0;
  int count = 0;
  for (char c : text) {
    int value = sextet(c);
    if (value < 0) return std::nullopt;
    bits = bits << 6 | static_cast<uint32_t>(value);
    count += 6;
    if (count >= 8) {
      count -= 8;
      out += static_cast<char>(bits >> count & 0xFF);
    }
  }
  return out;
}

std::string FileUrl(const std::string &path) {
  std::string url = "file://";
  for (unsigned char c : path) {
    if (isalnum(c) || strchr("/-._~", c) != nullptr) {
      url += static_cast<char>(c);
    } else {
      char escape[4];
      snprintf(escape, sizeof escape, "%%%02X", c);
      url += escape;
    }
  }
  return url;
}

}  // namespace cdp

namespace {

using cdp::JsonQuote;
using cdp::JsonRaw;
using cdp::JsonString;

// A generous allowance for a command's answer: a test machine may be busy building.
constexpr double kCommandTimeoutS = 30;
// How long Browser.close may take before the browser is killed.
constexpr double kCloseGraceS = 5;

const char *const kInstalledExecutables[] = {"/usr/lib/chromium/chromium", "/usr/bin/chromium"};

bool IsExecutableFile(const std::string &path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

std::string ReadWholeFile(const std::string &path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string Shortened(const std::string &text, size_t limit = 300) {
  return text.size() <= limit ? text : text.substr(0, limit) + "...";
}

void RemoveTree(const std::string &path) {
  auto remove_one = [](const char *file, const struct stat *, int, struct FTW *) {
    return remove(file);
  };
  nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS);
}

// The processes whose command line mentions text. Chromium's crash handler detaches itself into
// a session of its own, beyond the reach of the process group; it is found by the directory its
// command line names (under the HOME we give the browser).
std::vector<pid_t> ProcessesMentioning(const std::string &text) {
  std::vector<pid_t> found;
  DIR *proc = opendir("/proc");
  while (dirent *entry = proc != nullptr ? readdir(proc) : nullptr) {
    pid_t pid = static_cast<pid_t>(atoi(entry->d_name));
    if (pid <= 0) continue;
    std::string command_line = ReadWholeFile("/proc/" + std::to_string(pid) + "/cmdline");
    if (command_line.find(text) != std::string::npos) found.push_back(pid);
  }
  if (proc != nullptr) closedir(proc);
  return found;
}

// Writes to a pipe whose reader has gone fail with EPIPE instead of killing the test with
// SIGPIPE: the signal is blocked in this thread for the write, and one it raised is taken back.
class SigpipeBlocked {
 public:
  SigpipeBlocked() {
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    sigset_t sigpipe;
    sigemptyset(&sigpipe);
    sigaddset(&sigpipe, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &sigpipe, &old_mask_);
  }
  ~SigpipeBlocked() {
    if (!was_pending_) {
      sigset_t sigpipe;
      sigemptyset(&sigpipe);
      sigaddset(&sigpipe, SIGPIPE);
      const struct timespec now = {0, 0};
      while (sigtimedwait(&sigpipe, nullptr, &now) == SIGPIPE) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_mask_, nullptr);
  }

 private:
  bool was_pending_ = false;
  sigset_t old_mask_;
};

std::string Number(double value) {
  char text[32];
  snprintf(text, sizeof text, "%.3f", std::isfinite(value) ? value : 0.0);
  return text;
}

}  // namespace

std::string Browser::Executable() {
  if (const char *chosen = getenv("HD_TEST_CHROMIUM")) {
    return IsExecutableFile(chosen) ? chosen : "";
  }
  for (const char *path : kInstalledExecutables) {
    if (IsExecutableFile(path)) return path;
  }
  return "";
}

std::unique_ptr<Browser> Browser::Launch(std::string *why, int width, int height) {
  std::string executable = Executable();
  std::string ignored;
  if (why == nullptr) why = &ignored;
  if (executable.empty()) {
    const char *chosen = getenv("HD_TEST_CHROMIUM");
    *why = chosen != nullptr
               ? std::string("HD_TEST_CHROMIUM=") + chosen + " is not an executable file"
               : "Chromium is not installed: neither /usr/lib/chromium/chromium nor "
                 "/usr/bin/chromium is an executable file (apt-get install chromium, or set "
                 "HD_TEST_CHROMIUM)";
    return nullptr;
  }
  std::unique_ptr<Browser> browser(new Browser);
  if (!browser->Start(executable, width, height)) {
    *why = executable + " did not start: " + browser->error_;
    return nullptr;
  }
  return browser;
}

bool Browser::Start(const std::string &executable, int width, int height) {
  std::string dir_template = "/tmp/hd-browser-XXXXXX";
  if (mkdtemp(&dir_template[0]) == nullptr) {
    error_ = std::string("cannot make a temporary directory: ") + strerror(errno);
    return false;
  }
  dir_ = dir_template;
  const std::string home = dir_ + "/home";
  mkdir(home.c_str(), 0700);

  std::vector<std::string> args = {
      executable,
      "--headless=new",
      "--no-sandbox",  // the tests run as root, where Chromium's sandbox refuses to start
      "--disable-gpu",
      "--disable-dev-shm-usage",  // containers often have a tiny /dev/shm
      "--no-first-run",
      "--no-default-browser-check",
      "--remote-debugging-pipe",
      "--user-data-dir=" + dir_ + "/profile",
      "--window-size=" + std::to_string(width) + "," + std::to_string(height),
      "about:blank",
  };
  // Chromium keeps things outside its profile too (crash reports under ~/.config, scratch
  // directories under ~/.cache): they go into the directory removed with it, not the user's.
  std::vector<std::string> env;
  for (char **e = environ; *e != nullptr; e++) {
    std::string_view name(*e, strcspn(*e, "="));
    if (name != "HOME" && name != "XDG_CONFIG_HOME" && name != "XDG_CACHE_HOME") env.push_back(*e);
  }
  env.push_back("HOME=" + home);
  env.push_back("XDG_CONFIG_HOME=" + home + "/.config");
  env.push_back("XDG_CACHE_HOME=" + home + "/.cache");

  // Built before fork: in the child of a threaded test, malloc could wait forever on a lock.
  std::vector<char *> argv, envp;
  for (std::string &a : args) argv.push_back(&a[0]);
  argv.push_back(nullptr);
  for (std::string &e : env) envp.push_back(&e[0]);
  envp.push_back(nullptr);

  int commands[2], answers[2];
  if (pipe2(commands, O_CLOEXEC) != 0) {
    error_ = std::string("pipe: ") + strerror(errno);
    return false;
  }
  to_browser_ = commands[1];
  if (pipe2(answers, O_CLOEXEC) != 0) {
    close(commands[0]);
    error_ = std::string("pipe: ") + strerror(errno);
    return false;
  }
  from_browser_ = answers[0];
  const std::string log_path = dir_ + "/chromium.log";
  int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
  const pid_t test = getpid();

  pid_ = fork();
  if (pid_ == 0) {
    // Its own process group, so that all of its processes can be killed together.
    setpgid(0, 0);
    // If the test dies (a crash, a sanitizer report) the browser must not outlive it. Strictly,
    // this is when the thread that launched it ends.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != test) _exit(126);
    // Out of the way first: a descriptor may already be one of 0 to 4.
    int read_commands = fcntl(commands[0], F_DUPFD_CLOEXEC, 10);
    int write_answers = fcntl(answers[1], F_DUPFD_CLOEXEC, 10);
    int high_log = fcntl(log, F_DUPFD_CLOEXEC, 10);
    int high_null = fcntl(null, F_DUPFD_CLOEXEC, 10);
    if (read_commands < 0 || write_answers < 0 || high_log < 0 || high_null < 0) _exit(125);
    dup2(high_null, 0);
    dup2(high_log, 1);
    dup2(high_log, 2);
    dup2(read_commands, 3);
    dup2(write_answers, 4);
    syscall(SYS_close_range, 5, ~0U, 0);
    sigset_t nothing;
    sigemptyset(&nothing);
    sigprocmask(SIG_SETMASK, &nothing, nullptr);
    execve(argv[0], argv.data(), envp.data());
    static const char kFailed[] = "browser.cc: execve of the browser failed\n";
    ssize_t ignored = write(2, kFailed, sizeof kFailed - 1);
    (void)ignored;
    _exit(127);
  }
  const int fork_errno = errno;
  close(commands[0]);
  close(answers[1]);
  if (log >= 0) close(log);
  if (null >= 0) close(null);
  if (pid_ < 0) {
    error_ = std::string("fork: ") + strerror(fork_errno);
    return false;
  }
  // Also here, as the child may not have run yet: the group must exist before it is killed.
  setpgid(pid_, pid_);
  fcntl(to_browser_, F_SETFL, fcntl(to_browser_, F_GETFL) | O_NONBLOCK);

  // The first answer also tells that the browser is up, which takes a while on a busy machine.
  Deadline startup(kCommandTimeoutS);
  std::optional<std::string> target =
      Command("Target.createTarget", "{\"url\":\"about:blank\"}", "", startup);
  std::optional<std::string> target_id;
  if (target) target_id = JsonString(*target, {"result", "targetId"});
  if (!target_id) {
    // A browser that closed the pipe is probably exiting: its status tells why.
    int status = 0;
    pid_t waited = 0;
    for (Deadline exiting(1);
         (waited = waitpid(pid_, &status, WNOHANG)) == 0 && !exiting.Passed();) {
      usleep(10000);
    }
    if (waited == pid_) {
      pid_ = -1;
      error_ += WIFEXITED(status) ? "; it exited with status " + std::to_string(WEXITSTATUS(status))
                                  : "; it was killed by signal " + std::to_string(WTERMSIG(status));
    }
    error_ += LogTail();
    return false;
  }
  std::optional<std::string> attached =
      Command("Target.attachToTarget",
              "{\"targetId\":" + JsonQuote(*target_id) + ",\"flatten\":true}", "", startup);
  std::optional<std::string> session;
  if (attached) session = JsonString(*attached, {"result", "sessionId"});
  if (!session) {
    error_ += LogTail();
    return false;
  }
  session_ = *session;
  // The window of --window-size has room for a toolbar even when headless, so the page would be
  // smaller than asked; the page's own size and pixel ratio are set outright instead.
  const std::string metrics = "{\"width\":" + std::to_string(width) +
                              ",\"height\":" + std::to_string(height) +
                              ",\"deviceScaleFactor\":1,\"mobile\":false}";
  const std::pair<const char *, std::string> page_setup[] = {
      {"Page.enable", "{}"},
      {"Page.setLifecycleEventsEnabled", "{\"enabled\":true}"},  // load events with loaderIds
      {"Runtime.enable", "{}"},  // console messages and uncaught exceptions
      {"Emulation.setDeviceMetricsOverride", metrics},
  };
  for (const auto &[method, params] : page_setup) {
    if (!Command(method, params, session_, startup)) {
      error_ += LogTail();
      return false;
    }
  }
  started_ = true;
  return true;
}

Browser::~Browser() { Stop(); }

void Browser::Stop() {
  if (pid_ > 0) {
    // Asked first: a browser that shuts down cleanly leaves nothing behind it. One that did not
    // start is not asked: it might not answer either.
    Deadline grace(kCloseGraceS);
    if (started_) Command("Browser.close", "{}", "", grace);
    // Waited for without reaping it: while the leader is a zombie its pid, and so the group's
    // id, cannot be taken by another process that the kill below would then hit.
    for (;;) {
      siginfo_t info = {};
      int waited = waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT);
      if (waited != 0 || info.si_pid == pid_ || grace.Passed()) break;
      usleep(10000);
    }
    // Its zygotes outlive it for a while.
    kill(-pid_, SIGKILL);
  }
  std::vector<pid_t> stragglers;
  if (!dir_.empty()) stragglers = ProcessesMentioning(dir_ + "/");
  for (pid_t straggler : stragglers) kill(straggler, SIGKILL);
  if (pid_ > 0) waitpid(pid_, nullptr, 0);
  if (to_browser_ >= 0) close(to_browser_);
  if (from_browser_ >= 0) close(from_browser_);
  to_browser_ = from_browser_ = -1;
  if (!dir_.empty()) {
    // Killed processes are gone once reaped: by init, or by this process where it is their
    // subreaper (they are then reaped here).
    Deadline gone(kCloseGraceS);
    for (;;) {
      if (pid_ > 0) {
        while (waitpid(-pid_, nullptr, WNOHANG) > 0) {
        }
      }
      for (pid_t straggler : stragglers) waitpid(straggler, nullptr, WNOHANG);
      if (ProcessesMentioning(dir_ + "/").empty() || gone.Passed()) break;
      usleep(10000);
    }
    RemoveTree(dir_);
    dir_.clear();
  }
  pid_ = -1;
}

std::string Browser::Log() const {
  return dir_.empty() ? "" : ReadWholeFile(dir_ + "/chromium.log");
}

// The end of the log for an error message, without Chromium's complaints that a container has
// no D-Bus, which are always there and never the reason.
std::string Browser::LogTail() const {
  std::vector<std::string> lines;
  std::istringstream log(Log());
  for (std::string line; std::getline(log, line);) {
    if (line.find("dbus") == std::string::npos) lines.push_back(line);
  }
  if (lines.empty()) return "; Chromium's log is empty";
  const size_t kLines = 20;
  std::string tail = "; Chromium's log ends:\n";
  for (size_t i = lines.size() > kLines ? lines.size() - kLines : 0; i < lines.size(); i++) {
    tail += lines[i] + "\n";
  }
  return tail;
}

bool Browser::Send(const std::string &message, const Deadline &deadline) {
  SigpipeBlocked sigpipe_blocked;
  for (size_t sent = 0; sent < message.size();) {
    ssize_t n = write(to_browser_, message.data() + sent, message.size() - sent);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN) {
      error_ = std::string("cannot write to the browser: ") + strerror(errno);
      return false;
    }
    struct pollfd writable = {to_browser_, POLLOUT, 0};
    int ready = poll(&writable, 1, deadline.MillisecondsLeft());
    if (ready == 0) {
      error_ = "the browser read no command for " + deadline.Describe();
      return false;
    }
    if (ready < 0 && errno != EINTR) {
      error_ = std::string("poll: ") + strerror(errno);
      return false;
    }
  }
  return true;
}

std::optional<std::string> Browser::Receive(const Deadline &deadline) {
  for (;;) {
    size_t end = received_.find('\0', searched_);
    if (end != std::string::npos) {
      std::string message = received_.substr(0, end);
      received_.erase(0, end + 1);
      searched_ = 0;
      return message;
    }
    searched_ = received_.size();
    struct pollfd readable = {from_browser_, POLLIN, 0};
    int ready = poll(&readable, 1, deadline.MillisecondsLeft());
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      error_ = "no answer from the browser within " + deadline.Describe();
      return std::nullopt;
    }
    if (ready < 0) {
      error_ = std::string("poll: ") + strerror(errno);
      return std::nullopt;
    }
    char buffer[65536];
    ssize_t n = read(from_browser_, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      error_ = n == 0 ? "the browser closed its end of the pipe (did it exit?)"
                      : std::string("cannot read from the browser: ") + strerror(errno);
      return std::nullopt;
    }
    received_.append(buffer, static_cast<size_t>(n));
  }
}

std::optional<std::string> Browser::Command(const std::string &method, const std::string &params,
                                            const std::string &session, const Deadline &deadline) {
  if (crashed_ && !session.empty()) {
    error_ = method + ": the page crashed earlier";
    return std::nullopt;
  }
  const int id = next_id_++;
  std::string message = "{\"id\":" + std::to_string(id);
  if (!session.empty()) message += ",\"sessionId\":" + JsonQuote(session);
  message += ",\"method\":" + JsonQuote(method) + ",\"params\":" + params + "}";
  message += '\0';
  if (!Send(message, deadline)) {
    error_ = method + ": " + error_;
    return std::nullopt;
  }
  // Answers to earlier commands that timed out, and events, come first; the ids are ours alone.
  const std::string wanted_id = std::to_string(id);
  for (;;) {
    std::optional<std::string> received = Receive(deadline);
    if (!received) {
      error_ = method + ": " + error_;
      return std::nullopt;
    }
    if (JsonRaw(*received, {"id"}) != wanted_id) {
      Note(*received);
      if (crashed_ && !session.empty()) {
        error_ = method + ": the page crashed";
        return std::nullopt;
      }
      continue;
    }
    if (std::optional<std::string> failure = JsonString(*received, {"error", "message"})) {
      error_ = method + " failed: " + *failure;
      if (std::optional<std::string> data = JsonString(*received, {"error", "data"})) {
        error_ += " (" + *data + ")";
      }
      return std::nullopt;
    }
    return received;
  }
}

void Browser::Note(const std::string &event) {
  std::optional<std::string> method = JsonString(event, {"method"});
  if (!method || JsonString(event, {"sessionId"}) != session_) return;
  // Enough to see what went wrong in a page, not a log of everything it ever said.
  const size_t kConsoleLimit = 1 << 20;
  if (*method == "Page.lifecycleEvent") {
    std::optional<std::string> loader = JsonString(event, {"params", "loaderId"});
    if (loader && JsonString(event, {"params", "name"}) == "load") loaded_.push_back(*loader);
  } else if (*method == "Runtime.consoleAPICalled" && console_.size() < kConsoleLimit) {
    console_ += JsonString(event, {"params", "type"}).value_or("?") + ":";
    for (int i = 0;; i++) {
      const std::vector<std::string> arg = {"params", "args", std::to_string(i)};
      if (!JsonRaw(event, arg)) break;
      auto part = [&](const char *key) {
        std::vector<std::string> path = arg;
        path.push_back(key);
        return path;
      };
      std::optional<std::string> text = JsonString(event, part("value"));
      if (!text) text = JsonRaw(event, part("value"));
      if (!text) text = JsonString(event, part("description"));
      if (!text) text = JsonString(event, part("type"));
      console_ += " " + text.value_or("?");
    }
    console_ += "\n";
  } else if (*method == "Runtime.exceptionThrown" && console_.size() < kConsoleLimit) {
    std::optional<std::string> text =
        JsonString(event, {"params", "exceptionDetails", "exception", "description"});
    if (!text) text = JsonString(event, {"params", "exceptionDetails", "text"});
    console_ += "uncaught exception: " + text.value_or("?") + "\n";
  } else if (*method == "Inspector.targetCrashed") {
    crashed_ = true;
    console_ += "the page crashed\n";
  }
}

bool Browser::Open(const std::string &path, double timeout_s) {
  if (path.empty() || path[0] != '/') {
    error_ = "Open needs an absolute path, not \"" + path + "\"";
    return false;
  }
  Deadline deadline(timeout_s);
  loaded_.clear();
  std::optional<std::string> navigated = Command(
      "Page.navigate", "{\"url\":" + JsonQuote(cdp::FileUrl(path)) + "}", session_, deadline);
  if (!navigated) return false;
  if (std::optional<std::string> failure = JsonString(*navigated, {"result", "errorText"})) {
    error_ = "cannot open " + path + ": " + *failure;
    return false;
  }
  std::optional<std::string> loader = JsonString(*navigated, {"result", "loaderId"});
  if (!loader) return true;  // only the fragment changed: the document is the one loaded already
  // The load event may have come before the answer to Page.navigate.
  while (std::find(loaded_.begin(), loaded_.end(), *loader) == loaded_.end()) {
    std::optional<std::string> event = Receive(deadline);
    if (!event) {
      error_ = "opening " + path + ": no load event: " + error_;
      return false;
    }
    Note(*event);
    if (crashed_) {
      error_ = "opening " + path + ": the page crashed";
      return false;
    }
  }
  return true;
}

std::optional<std::string> Browser::Evaluate(const std::string &expression,
                                             const Deadline &deadline,
                                             std::optional<std::string> *exception) {
  exception->reset();
  // The page serialises the value, so the answer always holds a plain string. The expression
  // goes on lines of its own, so that a // comment at its end cannot swallow the parenthesis.
  const std::string wrapped = "(async () => JSON.stringify(await (\n" + expression + "\n)))()";
  std::optional<std::string> answer =
      Command("Runtime.evaluate",
              "{\"expression\":" + JsonQuote(wrapped) +
                  ",\"awaitPromise\":true,\"returnByValue\":true,\"userGesture\":true}",
              session_, deadline);
  if (!answer) return std::nullopt;
  if (JsonRaw(*answer, {"result", "exceptionDetails"})) {
    // An Error has a description (its message and stack); a thrown string or number a value.
    const std::vector<std::string> details = {"result", "exceptionDetails"};
    auto at = [&details](std::initializer_list<const char *> keys) {
      std::vector<std::string> path = details;
      path.insert(path.end(), keys.begin(), keys.end());
      return path;
    };
    *exception = JsonString(*answer, at({"exception", "description"}));
    if (!*exception) *exception = JsonString(*answer, at({"exception", "value"}));
    if (!*exception) *exception = JsonRaw(*answer, at({"exception", "value"}));
    if (!*exception) *exception = JsonString(*answer, at({"text"}));
    if (!*exception) *exception = "(no description)";
    error_ = "`" + Shortened(expression) + "` threw: " + **exception;
    return std::nullopt;
  }
  if (JsonString(*answer, {"result", "result", "type"}) == "undefined") return "undefined";
  std::optional<std::string> value = JsonString(*answer, {"result", "result", "value"});
  if (!value) error_ = "Runtime.evaluate: an answer without a value: " + Shortened(*answer);
  return value;
}

std::optional<std::string> Browser::Eval(const std::string &expression, double timeout_s) {
  std::optional<std::string> exception;
  return Evaluate(expression, Deadline(timeout_s), &exception);
}

std::optional<std::string> Browser::EvalString(const std::string &expression, double timeout_s) {
  std::optional<std::string> json = Eval(expression, timeout_s);
  if (!json) return std::nullopt;
  std::optional<std::string> text = JsonString(*json, {});
  if (!text) error_ = "`" + Shortened(expression) + "` is not a string but " + Shortened(*json);
  return text;
}

std::optional<double> Browser::EvalNumber(const std::string &expression, double timeout_s) {
  std::optional<std::string> json = Eval(expression, timeout_s);
  if (!json) return std::nullopt;
  // JSON.stringify writes NaN and the infinities as null, which is then not a number here.
  char *end = nullptr;
  double number = strtod(json->c_str(), &end);
  if (json->empty() || *end != '\0' || !isdigit(static_cast<unsigned char>(json->back()))) {
    error_ = "`" + Shortened(expression) + "` is not a finite number but " + Shortened(*json);
    return std::nullopt;
  }
  return number;
}

bool Browser::WaitFor(const std::string &expression, double timeout_s) {
  Deadline deadline(timeout_s);
  std::string last;
  for (;;) {
    // Each try may take a moment even when little or no time is left, so that a short timeout
    // still means one real try.
    Deadline this_try(std::max(deadline.SecondsLeft(), 1.0));
    std::optional<std::string> exception;
    std::optional<std::string> value = Evaluate("!!(" + expression + "\n)", this_try, &exception);
    if (value == "true") return true;
    if (!value && !exception) return false;  // the browser did not answer: error_ says so
    last = value ? "it was false" : "it last threw: " + *exception;
    if (deadline.Passed()) break;
    usleep(static_cast<useconds_t>(std::min(50, deadline.MillisecondsLeft()) * 1000));
    if (deadline.Passed()) break;
  }
  error_ = "waited " + deadline.Describe() + " for `" + Shortened(expression) + "`; " + last;
  return false;
}

bool Browser::Click(double x, double y) {
  Deadline deadline(kCommandTimeoutS);
  const std::string at = "\"x\":" + Number(x) + ",\"y\":" + Number(y);
  // Moved first, as a real pointer would be: pages may act on hover.
  for (const char *event : {
           "{\"type\":\"mouseMoved\",\"button\":\"none\",\"buttons\":0,",
           "{\"type\":\"mousePressed\",\"button\":\"left\",\"buttons\":1,\"clickCount\":1,",
           "{\"type\":\"mouseReleased\",\"button\":\"left\",\"buttons\":0,\"clickCount\":1,",
       }) {
    if (!Command("Input.dispatchMouseEvent", event + at + "}", session_, deadline)) return false;
  }
  return true;
}

bool Browser::ClickOn(const std::string &selector) {
  const std::string middle_of =
      "(selector => {"
      "  const element = document.querySelector(selector);"
      "  if (!element) throw new Error('nothing matches ' + selector);"
      "  element.scrollIntoView({block: 'center', inline: 'center'});"
      "  const box = element.getBoundingClientRect();"
      "  return [box.left + box.width / 2, box.top + box.height / 2];"
      "})";
  // A JSON string is also a JavaScript string literal.
  std::optional<std::string> exception;
  std::optional<std::string> middle =
      Evaluate(middle_of + "(" + JsonQuote(selector) + ")", Deadline(kCommandTimeoutS), &exception);
  if (!middle) {
    if (exception) error_ = "ClickOn(" + selector + "): " + *exception;
    return false;
  }
  std::optional<std::string> x = JsonRaw(*middle, {"0"}), y = JsonRaw(*middle, {"1"});
  if (!x || !y || *x == "null" || *y == "null") {
    error_ = "ClickOn(" + selector + "): no position in " + *middle;
    return false;
  }
  return Click(strtod(x->c_str(), nullptr), strtod(y->c_str(), nullptr));
}

bool Browser::Type(const std::string &text) {
  return Command("Input.insertText", "{\"text\":" + JsonQuote(text) + "}", session_,
                 Deadline(kCommandTimeoutS))
      .has_value();
}

bool Browser::Screenshot(const std::string &png_path) {
  std::optional<std::string> answer = Command("Page.captureScreenshot", "{\"format\":\"png\"}",
                                              session_, Deadline(kCommandTimeoutS));
  if (!answer) return false;
  std::optional<std::string> base64 = JsonString(*answer, {"result", "data"});
  std::optional<std::string> png = base64 ? cdp::Base64Decode(*base64) : std::nullopt;
  if (!png) {
    error_ = "Page.captureScreenshot: no base64 data in " + Shortened(*answer);
    return false;
  }
  FILE *file = fopen(png_path.c_str(), "wb");
  bool written = file != nullptr && fwrite(png->data(), 1, png->size(), file) == png->size();
  if (file != nullptr && fclose(file) != 0) written = false;
  if (!written) error_ = "cannot write " + png_path + ": " + strerror(errno);
  return written;
}

}  // namespace hdtest
