// heapdump-collector --http against the engines that read it: Debian's Prometheus (scraping
// /metrics, and each process as its own target through the service-discovery document) and
// `go tool pprof` (reading Go's heap profile paths), with real programs under LD_PRELOAD, plus
// the bearer token and hostile HTTP clients. Everything on 127.0.0.1.
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "harness.h"

namespace hdtest {
namespace {

struct HttpReply {
  int status = 0;  // 0: no answer
  std::string headers, body;
};

int Connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Sends request as is and reads the answer until the server closes (HTTP/1.0).
HttpReply Exchange(int port, const std::string &request) {
  HttpReply reply;
  int fd = Connect(port);
  if (fd < 0) return reply;
  timeval timeout = {60, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  size_t sent = 0;
  while (sent < request.size()) {
    ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::string all;
  char buf[65536];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) all.append(buf, static_cast<size_t>(n));
  close(fd);
  size_t end = all.find("\r\n\r\n");
  if (all.rfind("HTTP/1.", 0) != 0 || end == std::string::npos) return reply;
  reply.status = atoi(all.c_str() + 9);
  reply.headers = all.substr(0, end);
  reply.body = all.substr(end + 4);
  return reply;
}

HttpReply Get(int port, const std::string &path, const std::string &extra_headers = "") {
  return Exchange(port, "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1:" + std::to_string(port) +
                            "\r\n" + extra_headers + "\r\n");
}

// The port the collector chose for --http 127.0.0.1:0, from its log.
int HttpPort(const Collector &collector) {
  std::smatch m;
  std::string log;
  for (int i = 0; i < 500; i++) {
    log = collector.Log();
    if (std::regex_search(log, m, std::regex("serving HTTP on 127\\.0\\.0\\.1:([0-9]+)"))) {
      return std::stoi(m[1]);
    }
    usleep(10000);
  }
  ADD_FAILURE() << "no HTTP port in the log: " << log;
  return -1;
}

// The value of the sample of metric with labels exactly `labels` in an exposition; -1 if none.
long long Sample(const std::string &exposition, const std::string &metric,
                 const std::string &labels) {
  const std::string prefix = metric + labels + " ";
  for (const std::string &line : Lines(exposition)) {
    if (line.rfind(prefix, 0) == 0) return std::stoll(line.substr(prefix.size()));
  }
  return -1;
}

uint64_t LiveBytes(const std::string &socket, pid_t pid) {
  auto selector = ByPid(pid);
  auto r = TakeLiveSnapshot(socket, &selector);
  EXPECT_EQ(r->status, HD_OK);
  const hd_snapshot *s = r->only();
  if (s == nullptr) return 0;
  uint64_t bytes = 0;
  for (size_t i = 0; i < s->allocation_count; i++) bytes += s->allocations[i].size;
  return bytes;
}

class HttpTest : public ::testing::Test {
 protected:
  std::string dir = TempDir("http");
  RemoveWhenPassed cleanup{dir};
  Collector collector{dir};
  int port = -1;
  void StartCollector(std::vector<std::string> extra = {}) {
    collector.args = {"--http", "127.0.0.1:0"};
    collector.args.insert(collector.args.end(), extra.begin(), extra.end());
    collector.Start();
    port = HttpPort(collector);
  }
  std::string Labels(pid_t pid) {
    return "{pid=\"" + std::to_string(pid) + "\",process=\"heap_workload\"}";
  }
};

// A workload that grows and frees on command ("grow N": N blocks of 1000 bytes in grow_site).
struct Grower {
  Workload w;
  explicit Grower(const std::string &socket) : w(socket, {"grow"}) {}
  void Do(const std::string &command) {
    w.program->Send(command);
    EXPECT_EQ(w.program->ReadLine(), "ok");
  }
};

// /metrics has each process's counters, equal to what a snapshot of it shows, as it grows and
// frees; a process that exited leaves the exposition.
TEST_F(HttpTest, MetricsFollowTheHeapAndForgetExitedProcesses) {
  StartCollector();
  Grower g(collector.socket);
  for (const char *command : {"grow 300", "free", "grow 50"}) {
    g.Do(command);
    HttpReply r = Get(port, "/metrics");
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_NE(r.headers.find("text/plain; version=0.0.4"), std::string::npos) << r.headers;
    const long long live = Sample(r.body, "heapdump_live_bytes", Labels(g.w.pid));
    EXPECT_EQ(live, static_cast<long long>(LiveBytes(collector.socket, g.w.pid))) << command;
    EXPECT_GE(Sample(r.body, "heapdump_allocated_blocks_total", Labels(g.w.pid)), 300);
    EXPECT_GE(Sample(r.body, "heapdump_peak_live_bytes", Labels(g.w.pid)), 300000);
    EXPECT_EQ(Sample(r.body, "heapdump_collector_processes", ""), 1);
    EXPECT_NE(r.body.find("# TYPE heapdump_freed_bytes_total counter"), std::string::npos);
  }
  HttpReply one = Get(port, "/process/" + std::to_string(g.w.pid) + "/metrics");
  ASSERT_EQ(one.status, 200);
  EXPECT_EQ(Sample(one.body, "heapdump_live_bytes", Labels(g.w.pid)),
            static_cast<long long>(LiveBytes(collector.socket, g.w.pid)));
  EXPECT_EQ(one.body.find("heapdump_collector_"), std::string::npos);
  const pid_t gone = g.w.pid;
  EXPECT_EQ(g.w.program->Finish(), 0);
  EXPECT_TRUE(WaitUntil([&] {
    return Get(port, "/metrics").body.find("pid=\"" + std::to_string(gone) + "\"") ==
           std::string::npos;
  }));
  HttpReply missing = Get(port, "/process/" + std::to_string(gone) + "/metrics");
  EXPECT_EQ(missing.status, 404);
  EXPECT_EQ(missing.body, "no process " + std::to_string(gone) + " is profiled here\n");
}

// A process chooses its own name: one with a quote, a backslash, a line feed and a byte that is
// not UTF-8 leaves /metrics a valid exposition (promtool checks it) and /targets valid JSON.
TEST_F(HttpTest, AHostileProcessNameLeavesTheDocumentsValid) {
  StartCollector();
  ChildOptions named;
  named.path = dir + "/q\"b\\n\nx\xff";
  ASSERT_EQ(symlink(HD_CHILD, named.path.c_str()), 0);
  Child child(collector.socket, named);
  const std::string metrics = Get(port, "/metrics").body;
  EXPECT_NE(metrics.find("process=\"q\\\"b\\\\n\\nx\xef\xbf\xbd\"}"), std::string::npos) << metrics;
  WriteFile(dir + "/metrics.txt", metrics);
  ShellOutput lint = RunShell("promtool check metrics < metrics.txt", dir, {"PATH=/usr/bin:/bin"});
  EXPECT_EQ(lint.status, 0) << lint.out;
  WriteFile(dir + "/targets.json", Get(port, "/targets").body);
  ShellOutput json = RunShell(
      "python3 -c 'import json; t = json.load(open(\"targets.json\")); "
      "print(t[0][\"labels\"][\"process\"].encode())'",
      dir, {"PATH=/usr/bin:/bin"});
  EXPECT_EQ(json.status, 0) << json.out;
  EXPECT_EQ(json.out, "b'q\"b\\\\n\\nx\\xef\\xbf\\xbd'\n");
  child.Finish();
}

// What `go tool pprof -raw` prints of a profile: per leaf function, the four values of Go's heap
// profile (alloc_objects, alloc_space, inuse_objects, inuse_space), and whether every location
// has a mapping.
struct RawProfile {
  int status = -1;
  std::string out;
  std::map<std::string, std::vector<long long>> by_leaf;
  bool every_location_mapped = true;
  std::string sample_types;
};

RawProfile GoPprofRaw(const std::string &source, const std::string &home) {
  RawProfile p;
  ShellOutput o = RunShell("go tool pprof -raw '" + source + "' 2>&1", home,
                           {"HOME=" + home, "PATH=/usr/lib/go/bin:/usr/bin:/bin",
                            "GOCACHE=" + home + "/gocache", "PPROF_TMPDIR=" + home});
  p.status = o.status;
  p.out = o.out;
  std::map<int, std::string> functions;
  std::vector<std::pair<std::vector<long long>, int>> samples;
  enum { kNone, kSamples, kLocations } section = kNone;
  std::smatch m;
  const std::regex sample("^\\s*(\\d+)\\s+(\\d+)\\s+(\\d+)\\s+(\\d+): (\\d+)");
  const std::regex location("^\\s+(\\d+): 0x[0-9a-f]+ (M=\\d+ )?(\\S+)");
  for (const std::string &line : Lines(o.out)) {
    if (line == "Samples:") {
      section = kSamples;
    } else if (line == "Locations") {
      section = kLocations;
    } else if (line == "Mappings") {
      section = kNone;
    } else if (section == kSamples && line.find("alloc_objects") != std::string::npos) {
      p.sample_types = line;
    } else if (section == kSamples && std::regex_search(line, m, sample)) {
      samples.push_back({{std::stoll(m[1]), std::stoll(m[2]), std::stoll(m[3]), std::stoll(m[4])},
                         std::stoi(m[5])});
    } else if (section == kLocations && std::regex_search(line, m, location)) {
      functions[std::stoi(m[1])] = m[3];
      if (!m[2].matched) p.every_location_mapped = false;
    }
  }
  for (const auto &[values, leaf] : samples) {
    auto &sum = p.by_leaf[functions[leaf]];
    sum.resize(4);
    for (size_t i = 0; i < 4; i++) sum[i] += values[i];
  }
  return p;
}

// A sampled process (HEAPDUMP_SAMPLE_BYTES) says so to scrapers and profile readers: its rate
// in /metrics and as the profile's period, its values the estimates a snapshot shows, and the
// known site's estimate within five standard deviations of what it holds.
TEST_F(HttpTest, ASampledProcessCarriesItsRateToScrapersAndReaders) {
  StartCollector();
  Workload w(collector.socket, {"grow"}, false, {"HEAPDUMP_SAMPLE_BYTES=4096"});
  w.program->Send("grow 3000");
  ASSERT_EQ(w.program->ReadLine(), "ok");
  HttpReply r = Get(port, "/metrics");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Sample(r.body, "heapdump_sample_bytes", Labels(w.pid)), 4096) << r.body;
  EXPECT_EQ(Sample(r.body, "heapdump_live_bytes", Labels(w.pid)),
            static_cast<long long>(LiveBytes(collector.socket, w.pid)));
  const std::string url =
      "http://127.0.0.1:" + std::to_string(port) + "/debug/pprof/heap?pid=" + std::to_string(w.pid);
  RawProfile p = GoPprofRaw(url, dir);
  ASSERT_EQ(p.status, 0) << p.out;
  EXPECT_NE(p.out.find("Period: 4096\n"), std::string::npos) << p.out;
  EXPECT_NE(p.out.find("sampled: one block recorded per 4096 bytes"), std::string::npos) << p.out;
  // 3000 blocks of 1000 bytes, each recorded with p = 1 - e^(-1000/4096): the estimate's
  // standard deviation is 1000 * sqrt(3000 * ((1 - p) / p + p f (1 - f))), about 104 KB.
  const std::vector<long long> &grow = p.by_leaf["grow_site"];
  ASSERT_EQ(grow.size(), 4u) << p.out;
  EXPECT_NEAR(grow[3], 3000000, 5 * 104500) << p.out;
  EXPECT_EQ(grow[3] % 1000, 0) << p.out;  // whole blocks of the site's size
  EXPECT_EQ(w.program->Finish(), 0);
}

// A process armed from the dormant library (`heapdump arm`) says so to scrapers and profile
// readers: heapdump_recording 1, then 2 once disarmed; its bytes from before arming in
// heapdump_unattributed_bytes and in a comment of its profile, which holds what it allocated
// since.
TEST_F(HttpTest, AnArmedProcessCarriesItsStateToScrapersAndReaders) {
  StartCollector();
  Workload w(collector.socket, {"grow"}, false, {"HEAPDUMP_DORMANT=1"});
  const std::vector<std::string> env = {"HEAPDUMP_SOCKET=" + collector.socket,
                                        "PATH=/usr/bin:/bin"};
  const std::string cli = std::string(HD_CLI) + " ";
  // The workload allocates only when told: arm and disarm wait for its next allocation, which
  // `allocation` makes once the collector published the request.
  auto request = [&](const std::string &command, const std::string &logged,
                     const std::string &allocation) {
    ShellOutput o;
    std::thread t(
        [&] { o = RunShell(cli + command + " --pid " + std::to_string(w.pid), dir, env); });
    const std::string published = "process " + std::to_string(w.pid) + " " + logged;
    EXPECT_TRUE(hdtest::WaitUntil([&] {
      return collector.Log().find(published) != std::string::npos;
    })) << collector.Log();
    w.program->Send(allocation);
    EXPECT_EQ(w.program->ReadLine(), "ok");
    t.join();
    return o;
  };
  ShellOutput armed = request("arm", "armed", "grow 300");
  ASSERT_EQ(armed.status, 0) << armed.out;
  HttpReply r = Get(port, "/metrics");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(Sample(r.body, "heapdump_recording", Labels(w.pid)), 1) << r.body;
  EXPECT_GT(Sample(r.body, "heapdump_unattributed_bytes", Labels(w.pid)), 0) << r.body;
  const std::string url =
      "http://127.0.0.1:" + std::to_string(port) + "/debug/pprof/heap?pid=" + std::to_string(w.pid);
  RawProfile p = GoPprofRaw(url, dir);
  ASSERT_EQ(p.status, 0) << p.out;
  EXPECT_NE(p.out.find("armed: only blocks allocated while the process recorded have their stacks"),
            std::string::npos)
      << p.out;
  const std::vector<long long> &grow = p.by_leaf["grow_site"];
  ASSERT_EQ(grow.size(), 4u) << p.out;
  EXPECT_EQ(grow[3], 300000) << p.out;  // every block since arming, exactly
  // What was live before is in the profile's total, at a frame of its own (the process is idle
  // between the scrape and the profile: the same bytes).
  // (by_leaf keeps a name to its first blank.)
  const std::string frame = HD_UNATTRIBUTED_FRAME;
  const std::vector<long long> &before = p.by_leaf[frame.substr(0, frame.find(' '))];
  ASSERT_EQ(before.size(), 4u) << p.out;
  EXPECT_EQ(before[3], Sample(r.body, "heapdump_unattributed_bytes", Labels(w.pid))) << p.out;
  EXPECT_EQ(before[2], 0) << p.out;
  ShellOutput disarmed = request("disarm", "disarmed", "grow 1");
  ASSERT_EQ(disarmed.status, 0) << disarmed.out;
  EXPECT_EQ(Sample(Get(port, "/metrics").body, "heapdump_recording", Labels(w.pid)), 2);
  EXPECT_EQ(w.program->Finish(), 0);
}

// go tool pprof reads the profile straight from the collector: the known site exact, in Go's
// shape, with a mapping behind every location, from ?pid= and from the per-process paths.
TEST_F(HttpTest, GoToolPprofReadsTheKnownSitesFromEveryPath) {
  StartCollector();
  Grower g(collector.socket);
  g.Do("grow 300");
  g.Do("free");
  g.Do("grow 120");
  const std::string base = "http://127.0.0.1:" + std::to_string(port);
  const std::string pid = std::to_string(g.w.pid);
  const std::vector<std::string> paths = {"/debug/pprof/heap?pid=" + pid,
                                          "/debug/pprof/allocs?pid=" + pid,
                                          "/debug/pprof/heap",
                                          "/process/" + pid + "/debug/pprof/heap",
                                          "/process/" + pid + "/debug/pprof/allocs",
                                          "/name/heap_workload/debug/pprof/allocs"};
  for (const std::string &path : paths) {
    RawProfile p = GoPprofRaw(base + path, dir);
    ASSERT_EQ(p.status, 0) << path << ": " << p.out;
    // Go's order; as in Go, `allocs` defaults to what was allocated, `heap` to what is live.
    const bool allocs = path.find("/allocs") != std::string::npos;
    EXPECT_EQ(p.sample_types, allocs ? "alloc_objects/count alloc_space/bytes[dflt] "
                                       "inuse_objects/count inuse_space/bytes"
                                     : "alloc_objects/count alloc_space/bytes "
                                       "inuse_objects/count inuse_space/bytes[dflt]")
        << p.out;
    EXPECT_EQ(p.by_leaf["grow_site"], (std::vector<long long>{420, 420000, 120, 120000}))
        << path << ": " << p.out;
    EXPECT_TRUE(p.every_location_mapped) << p.out;
  }
  HttpReply unknown = Get(port, "/debug/pprof/heap?pid=999999");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(unknown.body, "no process 999999 is profiled here\n");
  Grower other(collector.socket);
  HttpReply which = Get(port, "/debug/pprof/heap");
  EXPECT_EQ(which.status, 400);
  EXPECT_EQ(which.body, "2 processes are profiled here: add ?pid=PID (see /debug/pprof/)\n");
  HttpReply by_name = Get(port, "/name/heap_workload/debug/pprof/heap");
  EXPECT_EQ(by_name.status, 409) << by_name.body;
  HttpReply index = Get(port, "/debug/pprof/");
  ASSERT_EQ(index.status, 200);
  for (pid_t each : {g.w.pid, other.w.pid}) {
    EXPECT_NE(index.body.find("/process/" + std::to_string(each) + "/debug/pprof/heap"),
              std::string::npos)
        << index.body;
  }
}

// Stored snapshots over HTTP: the list is `heapdump list --json`'s, and each one reads as a
// profile; an unknown id is a 404.
TEST_F(HttpTest, StoredSnapshotsAreListedAndServedAsProfiles) {
  StartCollector();
  Child child(collector.socket, "stored-for-http");
  ASSERT_EQ(child.snapshot_rc, 0);
  HttpReply list = Get(port, "/api/v1/snapshots");
  ASSERT_EQ(list.status, 200);
  ShellOutput cli = RunShell(std::string(HD_CLI) + " list --json", dir,
                             {"HEAPDUMP_SOCKET=" + collector.socket, "PATH=/usr/bin:/bin"});
  ASSERT_EQ(cli.status, 0) << cli.out;
  EXPECT_EQ(list.body, cli.out);
  const uint32_t id = StoredId(List(collector.socket), "stored-for-http");
  ASSERT_NE(id, 0u);
  RawProfile p = GoPprofRaw(
      "http://127.0.0.1:" + std::to_string(port) + "/api/v1/snapshots/" + std::to_string(id), dir);
  ASSERT_EQ(p.status, 0) << p.out;
  EXPECT_EQ(p.by_leaf["alpha_leaks"][3], 1000) << p.out;
  HttpReply unknown = Get(port, "/api/v1/snapshots/4000000");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(unknown.body, "no stored snapshot 4000000\n");
  child.Finish();
}

// With a token file, every request needs the token; an address that is not loopback is refused
// without one, at start, saying why.
TEST_F(HttpTest, ATokenGuardsEveryRequestAndAPublicAddressNeedsOne) {
  WriteFile(dir + "/token", "s3cret-token\n");
  StartCollector({"--http-token-file", dir + "/token"});
  for (const std::string path :
       {"/metrics", "/targets", "/debug/pprof/heap", "/api/v1/snapshots"}) {
    EXPECT_EQ(Get(port, path).status, 401) << path;
    EXPECT_EQ(Get(port, path, "Authorization: Bearer wrong-token!\r\n").status, 401) << path;
    EXPECT_EQ(Get(port, path, "Authorization: Bearer s3cret-token\r\n").status,
              path == "/debug/pprof/heap" ? 404 : 200)
        << path;  // no process is profiled: a 404 past the token
  }
  EXPECT_NE(Get(port, "/metrics").headers.find("WWW-Authenticate: Bearer"), std::string::npos);

  Collector open_to_all(dir + "/public");
  ShellOutput refused =
      RunShell(std::string(HD_COLLECTOR) + " --foreground --socket " + dir +
                   "/public.sock --storage " + dir + "/public-storage --http 0.0.0.0:0",
               dir, {"PATH=/usr/bin:/bin"});
  EXPECT_EQ(refused.status, 1) << refused.out;
  EXPECT_NE(refused.out.find("--http 0.0.0.0:0 is not a loopback address: give "
                             "--http-token-file FILE"),
            std::string::npos)
      << refused.out;
}

size_t OpenDescriptors(pid_t pid) {
  size_t n = 0;
  DIR *d = opendir(("/proc/" + std::to_string(pid) + "/fd").c_str());
  if (d == nullptr) return 0;
  while (readdir(d) != nullptr) n++;
  closedir(d);
  return n;
}

// A thousand connections at once, a client that sends half a request and waits, a 1 MB header
// and garbage: the collector stays within its limits and keeps registering processes and
// serving snapshots on its socket, and HTTP again once they are gone.
TEST_F(HttpTest, HostileHttpClientsDoNotStopTheCollector) {
  rlimit files;  // a thousand connections of our own need more than the usual 1,024 descriptors
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &files), 0);
  files.rlim_cur = std::min<rlim_t>(files.rlim_max, 4096);
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &files), 0);
  StartCollector();
  HttpReply huge =
      Exchange(port, "GET /metrics HTTP/1.0\r\nX-Big: " + std::string(1 << 20, 'a') + "\r\n\r\n");
  HttpReply garbage =
      Exchange(port, std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11) +
                         std::string(4096, '\xff') + "\r\n\r\n");
  std::vector<int> held;
  for (int i = 0; i < 1000; i++) {
    int fd = Connect(port);
    if (fd >= 0) held.push_back(fd);
  }
  int slow = Connect(port);
  ASSERT_GE(slow, 0);
  ASSERT_EQ(send(slow, "GET /metr", 9, MSG_NOSIGNAL), 9);
  // Meanwhile a process registers and is served on the socket.
  Grower g(collector.socket);
  g.Do("grow 10");
  const uint64_t live = LiveBytes(collector.socket, g.w.pid);
  EXPECT_GE(live, 10000u);
  EXPECT_LT(OpenDescriptors(collector.pid), 200u) << "connections beyond the limit are refused";
  EXPECT_EQ(huge.status, 431) << huge.headers;      // Request Header Fields Too Large
  EXPECT_EQ(garbage.status, 0) << garbage.headers;  // not HTTP: the connection is closed
  for (int fd : held) close(fd);
  close(slow);
  EXPECT_TRUE(WaitUntil([&] { return Get(port, "/metrics").status == 200; }));
  EXPECT_EQ(Sample(Get(port, "/metrics").body, "heapdump_live_bytes", Labels(g.w.pid)),
            static_cast<long long>(live));
  EXPECT_EQ(g.w.program->Finish(), 0);
}

// Without a token, a request is served only when it names a loopback host (a browser's request
// that DNS rebinding sent here names another site); anything but GET and HEAD is refused at its
// headers, saying what is allowed.
TEST_F(HttpTest, WithoutATokenOnlyRequestsToLoopbackNamesAreServed) {
  StartCollector();
  EXPECT_EQ(Get(port, "/metrics").status, 200);
  HttpReply rebound =
      Exchange(port, "GET /metrics HTTP/1.1\r\nHost: attacker.example:" + std::to_string(port) +
                         "\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(rebound.status, 403) << rebound.headers;
  EXPECT_EQ(rebound.body, "without a token, only requests to a loopback host name are served\n");
  for (const std::string host : {"localhost", "127.0.0.1", "127.1.2.3"}) {
    EXPECT_EQ(Exchange(port, "GET /metrics HTTP/1.1\r\nHost: " + host + ":" + std::to_string(port) +
                                 "\r\nConnection: close\r\n\r\n")
                  .status,
              200)
        << host;
  }
  HttpReply post = Exchange(port, "POST /metrics HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello");
  EXPECT_EQ(post.status, 405);
  EXPECT_NE(post.headers.find("Allow: GET, HEAD"), std::string::npos) << post.headers;
}

// What another user gets for a GET (status, then body), asked from a child that became that user.
std::pair<int, std::string> GetAs(uid_t uid, int port, const std::string &path) {
  int out[2];
  EXPECT_EQ(pipe(out), 0);
  pid_t child = fork();
  if (child == 0) {
    close(out[0]);
    HttpReply r;
    if (BecomeUser(uid, uid)) r = Get(port, path);
    std::string text = std::to_string(r.status) + "\n" + r.body;
    (void)!write(out[1], text.data(), text.size());
    _exit(0);
  }
  close(out[1]);
  std::string text;
  char buf[4096];
  ssize_t n;
  while ((n = read(out[0], buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
  close(out[0]);
  waitpid(child, nullptr, 0);
  size_t line = text.find('\n');
  if (line == std::string::npos) return {-1, text};
  return {atoi(text.c_str()), text.substr(line + 1)};
}

// As on the Unix socket, a root collector shows each local user their own processes only (and
// the collector's own counters to root only); a collector of another user serves that user and
// root, and refuses the rest.
TEST_F(HttpTest, WithoutATokenEachUserSeesWhatTheSocketWouldShowThem) {
  if (geteuid() != 0) GTEST_SKIP() << "other users' requests need root to make";
  StartCollector();
  Grower g(collector.socket);
  const std::string pid = "pid=\"" + std::to_string(g.w.pid) + "\"";
  EXPECT_NE(Get(port, "/metrics").body.find(pid), std::string::npos);
  auto nobody = GetAs(65534, port, "/metrics");
  EXPECT_EQ(nobody.first, 200) << nobody.second;
  EXPECT_EQ(nobody.second.find(pid), std::string::npos) << nobody.second;
  EXPECT_EQ(nobody.second.find("heapdump_collector_"), std::string::npos) << nobody.second;
  EXPECT_EQ(GetAs(65534, port, "/process/" + std::to_string(g.w.pid) + "/debug/pprof/heap").first,
            404);
  EXPECT_EQ(g.w.program->Finish(), 0);

  const std::string their_dir = TempDir("http-theirs");
  RemoveWhenPassed remove_theirs{their_dir};
  ASSERT_EQ(chown(their_dir.c_str(), 65534, 65534), 0);
  Collector theirs(their_dir);
  theirs.uid = 65534;
  theirs.gid = 65534;
  theirs.args = {"--http", "127.0.0.1:0"};
  theirs.Start();
  const int their_port = HttpPort(theirs);
  EXPECT_EQ(GetAs(65534, their_port, "/metrics").first, 200);
  EXPECT_EQ(Get(their_port, "/metrics").status, 200);  // root
  auto stranger = GetAs(65533, their_port, "/metrics");
  EXPECT_EQ(stranger.first, 403);
  EXPECT_EQ(stranger.second,
            "without a token, only the collector's own user and root may read it (see "
            "--http-token-file)\n");
}

// Profiles asked for at once are all made (two at a time, written one at a time) and agree.
TEST_F(HttpTest, ProfilesAskedForAtOnceAreAllServed) {
  StartCollector();
  Grower g(collector.socket);
  g.Do("grow 64");
  const std::string path = "/process/" + std::to_string(g.w.pid) + "/debug/pprof/heap";
  std::vector<HttpReply> replies(6);
  std::vector<std::thread> threads;
  for (HttpReply &r : replies) threads.emplace_back([&] { r = Get(port, path); });
  for (std::thread &t : threads) t.join();
  for (const HttpReply &r : replies) {
    EXPECT_EQ(r.status, 200) << r.body;
    EXPECT_GT(r.body.size(), 100u);
  }
  EXPECT_EQ(g.w.program->Finish(), 0);
}

// A stop does not wait for a profile whose process cannot be read: the request is cut off and
// the collector exits long before the read would have timed out.
TEST_F(HttpTest, AStopCutsOffAProfileInFlight) {
  StartCollector({"--read-timeout", "60"});
  Child victim(collector.socket, nullptr);
  MappedTable table(victim.pid);
  ASSERT_TRUE(table.ok());
  table.SetSlotLocked(0, true);  // as a writer stopped in the middle of a change would
  HttpReply cut;
  std::thread request(
      [&] { cut = Get(port, "/process/" + std::to_string(victim.pid) + "/debug/pprof/heap"); });
  usleep(300000);  // the request is waiting for the table
  const auto start = std::chrono::steady_clock::now();
  collector.Stop();  // expects exit status 0
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  request.join();
  EXPECT_LT(seconds, 30.0);
  EXPECT_NE(cut.status, 200);
  table.SetSlotLocked(0, false);
  victim.Kill();
}

// ---- Prometheus ----

std::string UrlEscape(const std::string &text) {
  std::string escaped;
  for (unsigned char c : text) {
    char hex[4];
    snprintf(hex, sizeof hex, "%%%02X", c);
    escaped += isalnum(c) ? std::string(1, static_cast<char>(c)) : std::string(hex);
  }
  return escaped;
}

struct Prometheus {
  std::unique_ptr<Program> program;
  int port = hdtest::FreePort();
  Prometheus(const std::string &dir, const std::string &config) {
    WriteFile(dir + "/prometheus.yml", config);
    program = std::make_unique<Program>(
        std::vector<std::string>{"/usr/bin/prometheus", "--config.file=" + dir + "/prometheus.yml",
                                 "--storage.tsdb.path=" + dir + "/tsdb",
                                 "--web.listen-address=127.0.0.1:" + std::to_string(port),
                                 "--log.level=warn"},
        std::vector<std::string>{});
  }
  ~Prometheus() { program->Kill(); }
  // The values of an instant query's series, by the value of label `by`.
  std::map<std::string, std::string> Query(const std::string &promql, const std::string &by) {
    HttpReply r = Get(port, "/api/v1/query?query=" + UrlEscape(promql));
    std::map<std::string, std::string> out;
    const std::regex series("\"" + by +
                            "\":\"([^\"]*)\"[^\\]]*\"value\":\\[[0-9.]+,\"([^\"]+)\"\\]");
    for (auto it = std::sregex_iterator(r.body.begin(), r.body.end(), series);
         it != std::sregex_iterator(); ++it) {
      out[(*it)[1]] = (*it)[2];
    }
    return out;
  }
};

// Prometheus scrapes /metrics: heapdump_live_bytes of a process equals a snapshot's live bytes
// after it grows and after it frees, and the process's series ends when it exits. Through the
// discovery document, each process is a target of its own.
TEST_F(HttpTest, PrometheusScrapesTheHeapAndEachProcessAsItsOwnTarget) {
  StartCollector();
  Grower a(collector.socket), b(collector.socket);
  const std::string collector_at = "127.0.0.1:" + std::to_string(port);
  Prometheus prometheus(dir,
                        "global:\n  scrape_interval: 1s\n"
                        "scrape_configs:\n"
                        "  - job_name: heapdump\n"
                        "    static_configs:\n"
                        "      - targets: ['" +
                            collector_at +
                            "']\n"
                            "  - job_name: heapdump-processes\n"
                            "    honor_labels: true\n"
                            "    http_sd_configs:\n"
                            "      - url: http://" +
                            collector_at +
                            "/targets\n"
                            "        refresh_interval: 1s\n");
  auto live_of = [&](pid_t pid, const std::string &job) {
    auto v = prometheus.Query(
        "heapdump_live_bytes{job=\"" + job + "\",pid=\"" + std::to_string(pid) + "\"}", "pid");
    return v.count(std::to_string(pid)) ? std::stoll(v[std::to_string(pid)]) : -1;
  };
  for (const char *command : {"grow 200", "free"}) {
    a.Do(command);
    const long long expected = static_cast<long long>(LiveBytes(collector.socket, a.w.pid));
    EXPECT_TRUE(WaitUntil([&] { return live_of(a.w.pid, "heapdump") == expected; }, 60))
        << command << ": " << live_of(a.w.pid, "heapdump") << " != " << expected;
  }
  // Each process its own target (up{job="heapdump-processes"} per pid), scraped at its path.
  EXPECT_TRUE(WaitUntil(
      [&] {
        auto up = prometheus.Query("up{job=\"heapdump-processes\"}", "pid");
        return up.size() == 2 && up[std::to_string(a.w.pid)] == "1" &&
               up[std::to_string(b.w.pid)] == "1";
      },
      60));
  EXPECT_TRUE(WaitUntil(
      [&] {
        return live_of(a.w.pid, "heapdump-processes") ==
               static_cast<long long>(LiveBytes(collector.socket, a.w.pid));
      },
      60));
  const pid_t gone = b.w.pid;
  EXPECT_EQ(b.w.program->Finish(), 0);
  EXPECT_TRUE(WaitUntil([&] { return live_of(gone, "heapdump") == -1; }, 60));
  EXPECT_TRUE(WaitUntil(
      [&] { return prometheus.Query("up{job=\"heapdump-processes\"}", "pid").size() == 1; }, 60));
  EXPECT_EQ(a.w.program->Finish(), 0);
}

// ---- docs/fleet.md as written ----

// The lines of the first indented code block after the line starting with `heading` in
// docs/fleet.md.
std::vector<std::string> DocBlock(const std::string &heading) {
  const std::string doc = ReadFile(std::string(HD_SOURCE_DIR) + "/docs/fleet.md");
  std::vector<std::string> lines;
  bool in_section = false;
  for (const std::string &line : Lines(doc)) {
    if (line.rfind(heading, 0) == 0) in_section = true;
    if (!in_section) continue;
    if (line.rfind("    ", 0) == 0) {
      lines.push_back(line.substr(4));
    } else if (!lines.empty()) {
      break;
    }
  }
  return lines;
}

// The first ```yaml block after the line starting with `heading` in docs/fleet.md.
std::string DocYaml(const std::string &heading) {
  const std::string doc = ReadFile(std::string(HD_SOURCE_DIR) + "/docs/fleet.md");
  size_t at = doc.find("\n" + heading);
  size_t start = at == std::string::npos ? at : doc.find("```yaml\n", at);
  size_t end = start == std::string::npos ? start : doc.find("```\n", start + 8);
  EXPECT_NE(end, std::string::npos) << heading;
  return end == std::string::npos ? "" : doc.substr(start + 8, end - start - 8);
}

std::string Replace(std::string text, const std::string &from, const std::string &to) {
  for (size_t at; (at = text.find(from)) != std::string::npos;) text.replace(at, from.size(), to);
  return text;
}

// docs/fleet.md's lines as a user runs them: the collector on 127.0.0.1, redis-server
// preloaded, curl and go tool pprof on it; its Prometheus configuration run by Prometheus (a 1 s
// scrape interval instead of 15 s, so that the test is quick), its rules file checked by
// promtool and its PromQL asked of that Prometheus. The doc's ports (9464 for the collector,
// 7400 for redis) are replaced by free ones, so that nothing else on the machine is in the way.
TEST_F(HttpTest, FleetDocRunsAsWritten) {
  const std::vector<std::string> start = DocBlock("## Turning it on");
  ASSERT_EQ(start.size(), 1u);
  EXPECT_EQ(start[0], "heapdump-collector --http 127.0.0.1:9464");
  const std::vector<std::string> lines = DocBlock("A program is profiled the usual way");
  ASSERT_EQ(lines.size(), 4u);
  const std::string bin_dirs = Replace(HD_COLLECTOR, "/heapdump-collector", "");
  const std::vector<std::string> env = {
      "PATH=" + bin_dirs + ":/usr/lib/go/bin:/usr/bin:/bin",
      "HEAPDUMP_SOCKET=" + collector.socket,
      "XDG_STATE_HOME=" + dir + "/state",
      "HOME=" + dir,
      "GOCACHE=" + dir + "/gocache",
  };
  const std::string http_port = std::to_string(hdtest::FreePort());
  const std::string redis_port = std::to_string(hdtest::FreePort());
  auto ports = [&](const std::string &text) {
    return Replace(Replace(text, "9464", http_port), "--port 7400", "--port " + redis_port);
  };
  const std::string wait_for_redis =
      "for i in $(seq 200); do curl -s http://127.0.0.1:" + http_port +
      "/targets | grep -q redis-server && break; sleep 0.05; done\n";
  // The server's output goes to a file: the test reads the script's output to its end, which
  // a server holding it would never give.
  ASSERT_EQ(lines[0].substr(lines[0].size() - 2), " &");
  std::string script = ports(start[0]) + "\n" +
                       ports(Replace(lines[0].substr(0, lines[0].size() - 2),
                                     "/usr/local/lib/libheapdump.so", HD_PRELOAD_LIB)) +
                       " >redis.log 2>&1 &\nredis=$!\necho $redis >redis.pid\n" + wait_for_redis;
  for (size_t i = 1; i < lines.size(); i++) {
    script += "echo '=== " + std::to_string(i) + "'\n" + ports(lines[i]) + "\n";
  }
  script += "echo '=== pprof'\n";
  const std::vector<std::string> pprof_lines = DocBlock("## go tool pprof");
  ASSERT_EQ(pprof_lines.size(), 2u);
  for (const std::string &line : pprof_lines) {
    // The example pid is redis's: inside the line's single quotes, by closing them around it.
    const bool quoted = line.find('\'') != std::string::npos;
    script += ports(Replace(line, "4242", quoted ? "'\"$redis\"'" : "$redis")) + "\n";
  }
  // Whatever happens, nothing the lines started outlives the test.
  struct Cleanup {
    std::string dir;
    std::vector<std::string> env;
    ~Cleanup() {
      RunShell(
          "pid=$(cat redis.pid); kill $pid 2>/dev/null || true\n"
          "for i in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.05; done\n"
          "heapdump-collector --stop || true",
          dir, env);
    }
  } cleanup{dir, env};
  ShellOutput o = RunShell(script, dir, env);
  ASSERT_EQ(o.status, 0) << o.out;
  EXPECT_NE(o.out.find("heapdump_live_bytes{pid=\""), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("process=\"redis-server\"}"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("\"service_name\":\"redis-server\""), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("Type: inuse_space"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("Type: alloc_space"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("Showing nodes accounting for"), std::string::npos) << o.out;

  // Prometheus with the doc's configuration, against that collector and redis.
  const std::string config = DocYaml("## Prometheus");
  ASSERT_NE(config.find("scrape_interval: 15s"), std::string::npos) << config;
  Prometheus prometheus(dir, ports(Replace(config, "scrape_interval: 15s", "scrape_interval: 1s")));
  EXPECT_TRUE(WaitUntil(
      [&] {
        return prometheus
                       .Query("heapdump_live_bytes{job=\"heapdump\",process=\"redis-server\"}",
                              "process")
                       .size() == 1 &&
               prometheus.Query("up{job=\"heapdump-processes\",process=\"redis-server\"}",
                                "process")["redis-server"] == "1";
      },
      60));
  const std::string doc = ReadFile(std::string(HD_SOURCE_DIR) + "/docs/fleet.md");
  std::smatch m;
  size_t queries = 0;
  for (auto it = doc.cbegin(); std::regex_search(it, doc.cend(), m, std::regex(":\n  `([^`]+)`"));
       it = m[0].second) {
    HttpReply r = Get(prometheus.port, "/api/v1/query?query=" + UrlEscape(m[1]));
    EXPECT_EQ(r.status, 200) << m[1] << ": " << r.body;
    EXPECT_NE(r.body.find("\"status\":\"success\""), std::string::npos) << m[1] << ": " << r.body;
    queries++;
  }
  EXPECT_EQ(queries, 4u);
  WriteFile(dir + "/heapdump-rules.yml", DocYaml("An alert on steady growth"));
  ShellOutput rules = RunShell("promtool check rules heapdump-rules.yml", dir, env);
  EXPECT_EQ(rules.status, 0) << rules.out;
  ShellOutput stop = RunShell("heapdump-collector --stop", dir, env);
  EXPECT_EQ(stop.status, 0) << stop.out;
}

}  // namespace
}  // namespace hdtest
