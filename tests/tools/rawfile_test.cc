// Raw snapshot files (tools/lib/rawfile.c) keep every kind of snapshot element: the protocol's
// kinds are all written, and real files (the rawfile fuzzer's seeds, written by heapdump) come
// back from a write and a read with each kind's elements as they were.
#include <stdio.h>

#include <map>
#include <string>

#include <gtest/gtest.h>

extern "C" {
#include <pb_common.h>

#include "heapdump/tools/rawfile.h"
}

namespace {

TEST(RawfileTest, EveryKindOfElementTheProtocolHasIsWritten) {
  heapdump_client_SnapshotElement element = heapdump_client_SnapshotElement_init_zero;
  pb_field_iter_t field;
  ASSERT_TRUE(pb_field_iter_begin(&field, heapdump_client_SnapshotElement_fields, &element));
  size_t kinds = 0;
  do {
    EXPECT_TRUE(hd_raw_writes_element(field.tag))
        << "SnapshotElement kind " << field.tag
        << " has no writer in tools/lib/rawfile.c (kElementWriters): raw files would drop it";
    kinds++;
  } while (pb_field_iter_next(&field));
  EXPECT_GE(kinds, 10u);
  EXPECT_FALSE(hd_raw_writes_element(0));
}

// Elements of each kind in a reassembled file.
std::map<std::string, size_t> Kinds(const hd_reassembler &r) {
  std::map<std::string, size_t> n;
  for (size_t i = 0; i < r.snapshot_count; i++) {
    const hd_snapshot *s = r.snapshots[i];
    n["snapshot_header"] += s->has_header;
    n["thread_info"] += s->thread_count;
    n["stack_trace"] += s->stack_trace_count;
    for (size_t t = 0; t < s->stack_trace_count; t++) {
      n["stack_trace_counters"] += s->stack_traces[t].has_counters;
    }
    n["executable_region"] += s->region_count;
    n["allocation"] += s->allocation_count;
    n["process_stats"] += s->has_stats;
    n["resident_memory"] += s->has_resident;
    n["stats_sample"] += s->sample_count;
    n["root_region"] += s->root_count;
    n["block_contents"] += s->block_count;
  }
  return n;
}

bool Read(const std::string &path, hd_reassembler *r, std::string *why) {
  FILE *in = fopen(path.c_str(), "rb");
  if (in == nullptr) return false;
  char error[256] = "";
  const int rc = hd_raw_read(in, r, error, sizeof error);
  fclose(in);
  *why = error;
  return rc == 0;
}

TEST(RawfileTest, RealFilesKeepEveryElementThroughAWriteAndARead) {
  std::map<std::string, size_t> seen;
  for (const char *name : {"leaky_run", "root_regions", "timeline", "resident", "peak"}) {
    const std::string path = std::string(HD_SOURCE_DIR) + "/tests/fuzz/corpus/rawfile/" + name;
    hd_reassembler first, second;
    hd_reassembler_init(&first);
    hd_reassembler_init(&second);
    std::string why;
    ASSERT_TRUE(Read(path, &first, &why)) << name << ": " << why;
    char *bytes = nullptr;
    size_t size = 0;
    FILE *out = open_memstream(&bytes, &size);
    char error[256] = "";
    ASSERT_EQ(hd_raw_write(&first, out, error, sizeof error), 0) << name << ": " << error;
    fclose(out);
    FILE *in = fmemopen(bytes, size, "rb");
    ASSERT_EQ(hd_raw_read(in, &second, error, sizeof error), 0) << name << ": " << error;
    fclose(in);
    free(bytes);
    EXPECT_EQ(Kinds(second), Kinds(first)) << name;
    // What was live at the peak mark, per trace and in all, comes back as it was.
    ASSERT_EQ(second.snapshot_count, first.snapshot_count);
    for (size_t i = 0; i < first.snapshot_count; i++) {
      const hd_snapshot *a = first.snapshots[i], *b = second.snapshots[i];
      EXPECT_EQ(b->stats.has_peak_mark_time, a->stats.has_peak_mark_time) << name;
      EXPECT_EQ(b->stats.peak_mark_time, a->stats.peak_mark_time) << name;
      EXPECT_EQ(b->stats.peak_mark_bytes, a->stats.peak_mark_bytes) << name;
      uint64_t peak_a = 0, peak_b = 0;
      for (size_t t = 0; t < a->stack_trace_count; t++) peak_a += a->stack_traces[t].peak_bytes;
      for (size_t t = 0; t < b->stack_trace_count; t++) peak_b += b->stack_traces[t].peak_bytes;
      EXPECT_EQ(peak_b, peak_a) << name;
      if (std::string(name) == "peak") {
        EXPECT_TRUE(a->stats.has_peak_mark_time);
        EXPECT_EQ(peak_a, a->stats.peak_mark_bytes);
        EXPECT_GT(peak_a, 12000000u);
      }
    }
    for (const auto &[kind, count] : Kinds(first)) seen[kind] += count;
    hd_reassembler_destroy(&first);
    hd_reassembler_destroy(&second);
  }
  // The files hold every kind, or this test would not show that each one survives.
  for (const auto &[kind, count] : seen) EXPECT_GT(count, 0u) << kind;
  EXPECT_EQ(seen.size(), 11u);
}

}  // namespace
