// The memory-over-time series: the collector's sampling seen through snapshots (a real daemon, a
// real program), and the series' thinning on its own (series.h, tested directly).
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness.h"

extern "C" {
#include "series.h"
}

namespace hdtest {
namespace {

std::string NameOf(const heapdump_client_StatsSample &s) {
  return s.has_snapshot_name ? s.snapshot_name : "";
}

void Sleep(double seconds) {
  timespec t{static_cast<time_t>(seconds),
             static_cast<long>((seconds - static_cast<time_t>(seconds)) * 1e9)};
  nanosleep(&t, nullptr);
}

// In time order, every sample complete, the named ones where the snapshots were.
void ExpectOrderedSeries(const hd_snapshot *s) {
  for (size_t i = 0; i < s->sample_count; i++) {
    const heapdump_client_StatsSample &v = s->samples[i];
    EXPECT_TRUE(v.has_live_bytes && v.has_live_blocks && v.has_bytes_allocated &&
                v.has_blocks_allocated && v.has_bytes_freed && v.has_blocks_freed);
    EXPECT_EQ(v.live_bytes, v.bytes_allocated - v.bytes_freed) << i;
    if (i > 0) {
      EXPECT_GE(v.timestamp, s->samples[i - 1].timestamp) << i;
      EXPECT_GE(v.bytes_allocated, s->samples[i - 1].bytes_allocated) << i;
    }
  }
}

TEST(Series, LiveAndStoredSnapshotsCarryTheSeriesUpToTheirMoment) {
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
  Collector collector(dir);
  collector.args = {"--sample-interval", "50"};
  collector.Start();
  Child child(collector.socket, "checkpoint");  // stores "checkpoint" once ready
  ASSERT_EQ(child.snapshot_rc, 0);
  const double waited = 0.8;
  Sleep(waited);
  auto selector = ByPid(child.pid);
  auto live = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(live->status, HD_OK) << live->ra.error;
  const hd_snapshot *s = live->only();
  ASSERT_NE(s, nullptr);
  ExpectOrderedSeries(s);
  // A sample every 50 ms since the process registered (before "checkpoint"), and the two marks;
  // a slow machine may miss a few ticks, never add any.
  const size_t ticks = static_cast<size_t>(waited / 0.05);
  EXPECT_GE(s->sample_count, ticks - 4);
  EXPECT_LE(s->sample_count, ticks + 40) << "the child needs at most 2 s to start";
  ASSERT_GE(s->sample_count, 3u);
  const heapdump_client_StatsSample &last = s->samples[s->sample_count - 1];
  EXPECT_EQ(NameOf(last), "live");
  // The child is idle: the last sample is the snapshot's own statistics.
  ASSERT_TRUE(s->has_stats);
  EXPECT_EQ(last.live_bytes, s->stats.live_bytes);
  EXPECT_EQ(last.live_blocks, s->stats.live_blocks);
  size_t checkpoints = 0;
  for (size_t i = 0; i < s->sample_count; i++) checkpoints += NameOf(s->samples[i]) == "checkpoint";
  EXPECT_EQ(checkpoints, 1u);
  // A live snapshot is kept nowhere: the next one does not show its moment, only its own.
  auto again = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(again->status, HD_OK) << again->ra.error;
  const hd_snapshot *a = again->only();
  size_t lives = 0;
  for (size_t i = 0; i < a->sample_count; i++) lives += NameOf(a->samples[i]) == "live";
  EXPECT_EQ(lives, 1u);
  EXPECT_EQ(NameOf(a->samples[a->sample_count - 1]), "live");
  EXPECT_GE(last.timestamp - s->samples[0].timestamp, static_cast<int64_t>(waited * 1e9 * 0.9));

  // The stored snapshot's series ends at its own moment, named after it.
  auto listed = List(collector.socket);
  uint32_t id = StoredId(listed, "checkpoint");
  ASSERT_NE(id, 0u);
  auto stored = Download(collector.socket, id);
  ASSERT_EQ(stored->status, HD_OK) << stored->ra.error;
  const hd_snapshot *c = stored->only();
  ASSERT_GE(c->sample_count, 1u);
  ExpectOrderedSeries(c);
  EXPECT_EQ(NameOf(c->samples[c->sample_count - 1]), "checkpoint");
  EXPECT_LE(c->samples[c->sample_count - 1].timestamp, s->samples[0].timestamp + 2000000000LL);
  child.Finish();
}

// The snapshots the collector's trigger stored of pid, in the order stored.
std::vector<Stored> Triggered(const std::string &socket, pid_t pid) {
  std::vector<Stored> out;
  for (const Stored &s : List(socket).items) {
    if (s.name == HD_TRIGGER_SNAPSHOT_NAME && s.pid == static_cast<uint64_t>(pid)) out.push_back(s);
  }
  return out;
}

// --trigger-live-bytes: a process growing past the threshold is stored once, with what it held
// then; after its live bytes fell below nine tenths of it, a second crossing is stored again.
TEST(Trigger, AProcessGrowingPastTheThresholdIsStoredOncePerCrossing) {
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
  Collector collector(dir);
  collector.args = {"--sample-interval", "20", "--trigger-live-bytes", "2000000"};
  collector.Start();
  Workload w(collector.socket, {"grow"});
  auto grow = [&](const char *command) {
    w.program->Send(command);
    EXPECT_EQ(w.program->ReadLine(), "ok") << command;
  };
  grow("grow 1500");  // 1.5 MB: below
  Sleep(0.3);
  EXPECT_TRUE(Triggered(collector.socket, w.pid).empty());
  grow("grow 1500");  // 3 MB
  ASSERT_TRUE(WaitUntil([&] { return Triggered(collector.socket, w.pid).size() == 1; }));
  std::vector<Stored> first = Triggered(collector.socket, w.pid);
  EXPECT_GE(first[0].live_bytes, 2000000u);
  grow("grow 500");  // still over: nothing new
  Sleep(0.3);
  EXPECT_EQ(Triggered(collector.socket, w.pid).size(), 1u);
  grow("free");  // below 9/10: armed again
  Sleep(0.3);
  grow("grow 2500");
  ASSERT_TRUE(WaitUntil([&] { return Triggered(collector.socket, w.pid).size() == 2; }));
  Sleep(0.3);
  EXPECT_EQ(Triggered(collector.socket, w.pid).size(), 2u);
  EXPECT_EQ(w.program->Finish(), 0);
}

// --trigger-limit-percent: the threshold is a share of the memory limit of the process's cgroup
// (a real one, made for the test where the machine lets it: cgroup v2's memory.max or v1's
// memory.limit_in_bytes).
TEST(Trigger, AShareOfTheCgroupMemoryLimitIsTheThreshold) {
  struct Hierarchy {
    std::string base, limit_file;
  };
  std::string group;
  std::string limit_file;
  for (const Hierarchy &h : {Hierarchy{"/sys/fs/cgroup/", "memory.max"},
                             Hierarchy{"/sys/fs/cgroup/memory/", "memory.limit_in_bytes"}}) {
    if (access((h.base + h.limit_file).c_str(), F_OK) != 0 &&
        access((h.base + "cgroup.procs").c_str(), F_OK) != 0)
      continue;
    if (h.limit_file == "memory.max" && access("/sys/fs/cgroup/cgroup.controllers", F_OK) != 0)
      continue;
    const std::string candidate = h.base + "heapdump-test-" + std::to_string(getpid());
    if (mkdir(candidate.c_str(), 0755) != 0) continue;
    if (access((candidate + "/" + h.limit_file).c_str(), W_OK) == 0) {
      group = candidate;
      limit_file = h.limit_file;
      break;
    }
    rmdir(candidate.c_str());
  }
  if (group.empty()) GTEST_SKIP() << "no memory cgroup can be made here";
  {
    std::ofstream(group + "/" + limit_file) << (64 << 20);  // 64 MiB: the trigger at 4%
  }
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
  Collector collector(dir);
  collector.args = {"--sample-interval", "20", "--trigger-limit-percent", "4"};
  collector.Start();
  // Into the cgroup before the program it runs registers (sh, instrumented too, registers and
  // execs it; the collector reads a process's limit at its first sample).
  std::vector<std::string> env = InstrumentedEnv(collector.socket, false);
  Program program(
      {"/bin/sh", "-c",
       "echo $$ > " + group + "/cgroup.procs && exec " + std::string(HD_WORKLOAD) + " grow"},
      env);
  int pid = 0;
  const std::string ready = program.ReadLine();
  ASSERT_EQ(sscanf(ready.c_str(), "ready %d", &pid), 1) << ready;
  auto grow = [&](const char *command) {
    program.Send(command);
    EXPECT_EQ(program.ReadLine(), "ok") << command;
  };
  grow("grow 2000");  // 2 MB: below 4% of 64 MiB (2.68 MB)
  Sleep(0.3);
  EXPECT_TRUE(Triggered(collector.socket, pid).empty());
  grow("grow 1500");  // 3.5 MB: over
  EXPECT_TRUE(WaitUntil([&] { return Triggered(collector.socket, pid).size() == 1; }));
  EXPECT_EQ(program.Finish(), 0);
  rmdir(group.c_str());
}

TEST(Series, NoSamplingLeavesOnlyTheSnapshotMoments) {
  std::string dir = TempDir();
  RemoveWhenPassed cleanup{dir};
  Collector collector(dir);
  collector.args = {"--sample-interval", "0"};
  collector.Start();
  Child child(collector.socket, "checkpoint");
  ASSERT_EQ(child.snapshot_rc, 0);
  Sleep(0.3);
  auto selector = ByPid(child.pid);
  auto live = TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(live->status, HD_OK) << live->ra.error;
  const hd_snapshot *s = live->only();
  ASSERT_EQ(s->sample_count, 2u);
  EXPECT_EQ(NameOf(s->samples[0]), "checkpoint");
  EXPECT_EQ(NameOf(s->samples[1]), "live");
  child.Finish();
}

hd_table_stats StatsOf(uint64_t live, uint64_t allocated) {
  hd_table_stats st{};
  st.live_bytes = live;
  st.live_blocks = live / 16;
  st.bytes_allocated = allocated + live;
  st.bytes_freed = allocated;
  return st;
}

// A day of samples fits in the series' bound, keeps its single highest sample (whole, with its
// own totals), its first and last moments, and its time order.
TEST(Series, ALongRunIsThinnedKeepingItsPeak) {
  hd_series series;
  hd_series_init(&series);
  const size_t ticks = 864000;  // 24 h at 100 ms
  const size_t peak_tick = 123457;
  uint64_t allocated = 0;
  for (size_t i = 0; i < ticks; i++) {
    const uint64_t live = i == peak_tick ? 1u << 30 : 1000 + (i % 97) * 16;
    allocated += 1u << 20;
    const hd_table_stats st = StatsOf(live, allocated);
    hd_series_add(&series, &st, static_cast<int64_t>(i) * 100000000);
  }
  ASSERT_LE(series.count, static_cast<size_t>(HD_SERIES_CAPACITY));
  ASSERT_GE(series.count, static_cast<size_t>(HD_SERIES_CAPACITY / 2));
  size_t peaks = 0;
  for (size_t i = 0; i < series.count; i++) {
    if (series.samples[i].live_bytes == 1u << 30) {
      peaks++;
      // The peak keeps its own moment.
      EXPECT_EQ(series.samples[i].timestamp, static_cast<int64_t>(peak_tick) * 100000000);
    }
    if (i > 0) {
      EXPECT_GT(series.samples[i].timestamp, series.samples[i - 1].timestamp);
    }
  }
  EXPECT_EQ(peaks, 1u);
  EXPECT_EQ(series.samples[0].timestamp, 0);  // where it started
  // Every sample is a moment that was, whole: its totals agree with its live bytes.
  for (size_t i = 0; i < series.count; i++) {
    EXPECT_EQ(series.samples[i].live_bytes,
              series.samples[i].bytes_allocated - series.samples[i].bytes_freed);
  }
  const int64_t last = series.samples[series.count - 1].timestamp;
  EXPECT_GE(last, static_cast<int64_t>(ticks - series.stride) * 100000000);

  // Stored snapshots' moments stay at most HD_SERIES_MARKS, the newest kept, in time order even
  // when their stores finish out of order (each pair here is remembered later one first).
  for (int m = 0; m < HD_SERIES_MARKS + 6; m += 2) {
    for (int k : {m + 1, m}) {
      hd_series_moment moment{};
      moment.at.timestamp = last + k;
      snprintf(moment.name, sizeof moment.name, "mark-%d", k);
      hd_series_remember(&series, &moment);
    }
  }
  ASSERT_EQ(series.mark_count, static_cast<size_t>(HD_SERIES_MARKS));
  EXPECT_STREQ(series.marks[0].name, "mark-6");
  EXPECT_STREQ(series.marks[HD_SERIES_MARKS - 1].name,
               ("mark-" + std::to_string(HD_SERIES_MARKS + 5)).c_str());
  for (size_t i = 1; i < series.mark_count; i++) {
    EXPECT_GT(series.marks[i].at.timestamp, series.marks[i - 1].at.timestamp) << i;
  }
  hd_series_destroy(&series);
}

}  // namespace
}  // namespace hdtest
