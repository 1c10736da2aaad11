// Tests of the pprof writer: profiles of snapshots built from real elements fed to the
// reassembler, and of live snapshots of real programs under LD_PRELOAD taken from a real
// collector. Each profile is decoded here with nanopb for structural checks, and read back with
// `go tool pprof` (skipped when go is not installed: CI installs golang-go).
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

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
#include <zlib.h>

extern "C" {
#include <pb_decode.h>

#include "heapdump/fidl/channel.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/pprof.h"
#include "heapdump/tools/sites.h"
#include "heapdump/tools/symbolize.h"
#include "heapdump_client.bindings.h"
#include "profile.pb.h"
}
#include "client.h"
#include "process.h"

namespace {

using hdtest::Collector;

std::string TempDir() { return hdtest::TempDir("pprof-test"); }

// ---- snapshots from elements ----

// A reassembler fed one element at a time, as hd_snapshot_receive does.
struct Stream {
  hd_reassembler r;
  Stream() { hd_reassembler_init(&r); }
  ~Stream() { hd_reassembler_destroy(&r); }
  Stream(const Stream &) = delete;
  Stream &operator=(const Stream &) = delete;

  void Add(const heapdump_client_SnapshotElement &element,
           const std::vector<uint64_t> &addresses = {}) {
    hd_element e = {&element, addresses.data(), addresses.size(), nullptr, 0};
    ASSERT_EQ(hd_reassembler_add(&r, &e), HD_OK) << r.error;
  }
  void Header(const char *name, uint64_t pid) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_snapshot_header_tag;
    auto &h = e.element.snapshot_header;
    h.has_process_name = h.has_process_koid = true;
    snprintf(h.process_name, sizeof h.process_name, "%s", name);
    h.process_koid = pid;
    Add(e);
  }
  void Region(uint64_t address, uint64_t size, uint64_t file_offset, const char *name,
              const std::vector<uint8_t> &build_id) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_executable_region_tag;
    auto &g = e.element.executable_region;
    g.has_address = g.has_size = g.has_file_offset = g.has_vaddr = g.has_name = true;
    g.address = address;
    g.size = size;
    g.file_offset = file_offset;
    g.vaddr = file_offset;
    snprintf(g.name, sizeof g.name, "%s", name);
    if (!build_id.empty()) {
      g.has_build_id = true;
      g.build_id.value.size = static_cast<pb_size_t>(build_id.size());
      memcpy(g.build_id.value.bytes, build_id.data(), build_id.size());
    }
    Add(e);
  }
  void Thread(uint64_t key, uint64_t tid, const char *name) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_thread_info_tag;
    auto &t = e.element.thread_info;
    t.has_thread_info_key = t.has_koid = t.has_name = true;
    t.thread_info_key = key;
    t.koid = tid;
    snprintf(t.name, sizeof t.name, "%s", name);
    Add(e);
  }
  // A stack trace, leaf first, sent in chunks of at most `chunk` addresses.
  void Trace(uint64_t key, const std::vector<uint64_t> &addresses, size_t chunk = 2,
             bool truncated = false) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_stack_trace_tag;
    e.element.stack_trace.has_stack_trace_key = true;
    e.element.stack_trace.stack_trace_key = key;
    e.element.stack_trace.has_truncated = truncated;
    e.element.stack_trace.truncated = truncated;
    if (addresses.empty()) Add(e);
    for (size_t i = 0; i < addresses.size(); i += chunk) {
      Add(e, std::vector<uint64_t>(addresses.begin() + i,
                                   addresses.begin() + std::min(addresses.size(), i + chunk)));
    }
  }
  void Counters(uint64_t key, uint64_t blocks, uint64_t bytes) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_stack_trace_counters_tag;
    auto &c = e.element.stack_trace_counters;
    c.has_stack_trace_key = c.has_allocated_blocks = c.has_allocated_bytes = true;
    c.stack_trace_key = key;
    c.allocated_blocks = blocks;
    c.allocated_bytes = bytes;
    Add(e);
  }
  void Allocation(uint64_t address, uint64_t size, uint64_t trace, uint64_t thread,
                  int64_t timestamp, uint64_t count = 1) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_allocation_tag;
    auto &a = e.element.allocation;
    a.has_address = a.has_size = a.has_stack_trace_key = a.has_thread_info_key = true;
    a.has_timestamp = true;
    a.address = address;
    a.size = size;
    a.stack_trace_key = trace;
    a.thread_info_key = thread;
    a.timestamp = timestamp;
    if (count != 1) {
      a.has_count = true;
      a.count = count;
    }
    Add(e);
  }
  void DroppedRecords(uint64_t allocations, uint64_t traces, uint64_t resources) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_process_stats_tag;
    auto &s = e.element.process_stats;
    s.has_dropped_allocations = s.has_dropped_stack_traces = s.has_dropped_resources = true;
    s.dropped_allocations = allocations;
    s.dropped_stack_traces = traces;
    s.dropped_resources = resources;
    Add(e);
  }
  // An armed process's statistics: bytes live from before it was armed.
  void Unattributed(uint64_t bytes) {
    heapdump_client_SnapshotElement e = heapdump_client_SnapshotElement_init_zero;
    e.which_element = heapdump_client_SnapshotElement_process_stats_tag;
    auto &s = e.element.process_stats;
    s.has_unattributed_bytes = s.has_recording = true;
    s.unattributed_bytes = bytes;
    s.recording = heapdump_client_RecordingState_RECORDING_ARMED;
    Add(e);
  }
  void Finish() { ASSERT_EQ(hd_reassembler_finish(&r), HD_OK) << r.error; }
};

// ---- writing and decoding profiles ----

struct WriteResult {
  int rc = 0;
  std::string error;
};

WriteResult WriteProfile(const hd_reassembler *r, const hd_pprof_options &options,
                         const std::string &path) {
  WriteResult result;
  FILE *out = fopen(path.c_str(), "wb");
  if (out == nullptr) {
    result.rc = -errno;
    result.error = "cannot create " + path;
    return result;
  }
  char error[256] = "unset";
  result.rc = hd_pprof_write(r, &options, out, error, sizeof error);
  result.error = error;
  fclose(out);
  return result;
}

using hdtest::ReadFile;

std::string Gunzip(const std::string &path) {
  std::string data;
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return data;
  char buf[65536];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) data.append(buf, static_cast<size_t>(n));
  gzclose(f);
  return data;
}

struct Label {
  int64_t key, str, num, num_unit;
};
struct Sample {
  std::vector<uint64_t> location_ids;
  std::vector<int64_t> values;
  std::vector<Label> labels;
};
struct Line {
  uint64_t function_id;
  int64_t line;
};
struct Location {
  uint64_t id, mapping_id, address;
  std::vector<Line> lines;
};

// A profile decoded field by field with nanopb, everything kept as written (ids, indices).
struct Profile {
  std::vector<perftools_profiles_ValueType> sample_types;
  std::vector<Sample> samples;
  std::vector<perftools_profiles_Mapping> mappings;
  std::vector<Location> locations;
  std::vector<perftools_profiles_Function> functions;
  std::vector<std::string> strings;
  std::vector<int64_t> comments;
  perftools_profiles_Profile scalars = perftools_profiles_Profile_init_zero;

  const std::string &Str(int64_t index) const {
    static const std::string invalid = "<invalid string index>";
    return index >= 0 && static_cast<size_t>(index) < strings.size() ? strings[index] : invalid;
  }
  const Location *FindLocation(uint64_t id) const {
    for (const Location &l : locations) {
      if (l.id == id) return &l;
    }
    return nullptr;
  }
  const perftools_profiles_Mapping *FindMapping(uint64_t id) const {
    for (const auto &m : mappings) {
      if (m.id == id) return &m;
    }
    return nullptr;
  }
  const perftools_profiles_Function *FindFunction(uint64_t id) const {
    for (const auto &f : functions) {
      if (f.id == id) return &f;
    }
    return nullptr;
  }
  // The label values of a sample by key: strings as is, numbers in decimal.
  std::map<std::string, std::string> Labels(const Sample &s) const {
    std::map<std::string, std::string> out;
    for (const Label &l : s.labels) {
      out[Str(l.key)] = l.str != 0 ? Str(l.str) : std::to_string(l.num);
    }
    return out;
  }
  // The program addresses of a sample, leaf first.
  std::vector<uint64_t> Stack(const Sample &s) const {
    std::vector<uint64_t> out;
    for (uint64_t id : s.location_ids) {
      const Location *l = FindLocation(id);
      out.push_back(l != nullptr ? l->address : 0);
    }
    return out;
  }
  std::vector<std::string> SampleTypes() const {
    std::vector<std::string> out;
    for (const auto &t : sample_types) out.push_back(Str(t.type) + "/" + Str(t.unit));
    return out;
  }
};

// Packed or not, a repeated varint field arrives as a stream of varints.
template <typename T>
bool DecodeVarints(pb_istream_t *stream, std::vector<T> *out) {
  while (stream->bytes_left > 0) {
    uint64_t v;
    if (!pb_decode_varint(stream, &v)) return false;
    out->push_back(static_cast<T>(v));
  }
  return true;
}

bool DecodeProfile(const std::string &bytes, Profile *p) {
  perftools_profiles_Profile &msg = p->scalars;
  msg.sample_type.arg = &p->sample_types;
  msg.sample_type.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
    perftools_profiles_ValueType t = perftools_profiles_ValueType_init_zero;
    if (!pb_decode(stream, perftools_profiles_ValueType_fields, &t)) return false;
    static_cast<std::vector<perftools_profiles_ValueType> *>(*arg)->push_back(t);
    return true;
  };
  msg.sample.arg = &p->samples;
  msg.sample.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
    Sample s;
    perftools_profiles_Sample m = perftools_profiles_Sample_init_zero;
    m.location_id.arg = &s.location_ids;
    m.location_id.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
      return DecodeVarints(stream, static_cast<std::vector<uint64_t> *>(*arg));
    };
    m.value.arg = &s.values;
    m.value.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
      return DecodeVarints(stream, static_cast<std::vector<int64_t> *>(*arg));
    };
    m.label.arg = &s.labels;
    m.label.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
      perftools_profiles_Label l = perftools_profiles_Label_init_zero;
      if (!pb_decode(stream, perftools_profiles_Label_fields, &l)) return false;
      static_cast<std::vector<Label> *>(*arg)->push_back({l.key, l.str, l.num, l.num_unit});
      return true;
    };
    if (!pb_decode(stream, perftools_profiles_Sample_fields, &m)) return false;
    static_cast<std::vector<Sample> *>(*arg)->push_back(s);
    return true;
  };
  msg.mapping.arg = &p->mappings;
  msg.mapping.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
    perftools_profiles_Mapping m = perftools_profiles_Mapping_init_zero;
    if (!pb_decode(stream, perftools_profiles_Mapping_fields, &m)) return false;
    static_cast<std::vector<perftools_profiles_Mapping> *>(*arg)->push_back(m);
    return true;
  };
  msg.location.arg = &p->locations;
  msg.location.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
    Location l{};
    perftools_profiles_Location m = perftools_profiles_Location_init_zero;
    m.line.arg = &l.lines;
    m.line.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
      perftools_profiles_Line line = perftools_profiles_Line_init_zero;
      if (!pb_decode(stream, perftools_profiles_Line_fields, &line)) return false;
      static_cast<std::vector<Line> *>(*arg)->push_back({line.function_id, line.line});
      return true;
    };
    if (!pb_decode(stream, perftools_profiles_Location_fields, &m)) return false;
    l.id = m.id;
    l.mapping_id = m.mapping_id;
    l.address = m.address;
    static_cast<std::vector<Location> *>(*arg)->push_back(l);
    return true;
  };
  msg.function.arg = &p->functions;
  msg.function.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
    perftools_profiles_Function f = perftools_profiles_Function_init_zero;
    if (!pb_decode(stream, perftools_profiles_Function_fields, &f)) return false;
    static_cast<std::vector<perftools_profiles_Function> *>(*arg)->push_back(f);
    return true;
  };
  msg.string_table.arg = &p->strings;
  msg.string_table.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
    std::string s(stream->bytes_left, '\0');
    if (!pb_read(stream, reinterpret_cast<pb_byte_t *>(&s[0]), s.size())) return false;
    static_cast<std::vector<std::string> *>(*arg)->push_back(s);
    return true;
  };
  msg.comment.arg = &p->comments;
  msg.comment.funcs.decode = [](pb_istream_t *stream, const pb_field_t *, void **arg) {
    return DecodeVarints(stream, static_cast<std::vector<int64_t> *>(*arg));
  };
  pb_istream_t stream =
      pb_istream_from_buffer(reinterpret_cast<const pb_byte_t *>(bytes.data()), bytes.size());
  return pb_decode(&stream, perftools_profiles_Profile_fields, &msg);
}

// Reads a profile file: gzip, then protobuf.
::testing::AssertionResult Load(const std::string &path, Profile *p) {
  std::string raw = ReadFile(path);
  if (raw.size() < 2 || static_cast<uint8_t>(raw[0]) != 0x1f ||
      static_cast<uint8_t>(raw[1]) != 0x8b) {
    return ::testing::AssertionFailure() << path << " is not gzip-compressed";
  }
  std::string bytes = Gunzip(path);
  if (bytes.empty()) return ::testing::AssertionFailure() << path << " does not decompress";
  if (!DecodeProfile(bytes, p)) return ::testing::AssertionFailure() << path << " does not decode";
  return ::testing::AssertionSuccess();
}

const std::vector<std::string> kSampleTypes = {"inuse_objects/count", "inuse_space/bytes",
                                               "alloc_objects/count", "alloc_space/bytes"};
// The same, then what was live at the peak mark, for snapshots that have one.
const std::vector<std::string> kSampleTypesWithPeak = {"inuse_objects/count", "inuse_space/bytes",
                                                       "alloc_objects/count", "alloc_space/bytes",
                                                       "peak_objects/count",  "peak_space/bytes"};

// What profile.proto requires of any profile, and what the writer promises on top.
void ExpectWellFormed(const Profile &p) {
  ASSERT_FALSE(p.strings.empty());
  EXPECT_EQ(p.strings[0], "");
  std::set<std::string> distinct(p.strings.begin(), p.strings.end());
  EXPECT_EQ(distinct.size(), p.strings.size()) << "the string table has duplicates";
  const std::vector<std::string> types = p.SampleTypes();
  EXPECT_TRUE(types == kSampleTypes || types == kSampleTypesWithPeak)
      << ::testing::PrintToString(types);
  EXPECT_EQ(p.Str(p.scalars.period_type.type), "space");
  EXPECT_EQ(p.Str(p.scalars.period_type.unit), "bytes");
  EXPECT_EQ(p.scalars.period, 1);
  EXPECT_GT(p.scalars.time_nanos, 0);
  std::set<uint64_t> mapping_ids, location_ids, function_ids;
  for (const auto &m : p.mappings) {
    EXPECT_NE(m.id, 0u);
    EXPECT_TRUE(mapping_ids.insert(m.id).second) << "duplicate mapping id " << m.id;
    if (p.Str(m.filename) != HD_PPROF_UNMAPPED) {
      EXPECT_LT(m.memory_start, m.memory_limit);
    }
    EXPECT_NE(p.Str(m.filename), "<invalid string index>");
    EXPECT_NE(p.Str(m.build_id), "<invalid string index>");
  }
  for (const auto &f : p.functions) {
    EXPECT_NE(f.id, 0u);
    EXPECT_TRUE(function_ids.insert(f.id).second) << "duplicate function id " << f.id;
    EXPECT_NE(p.Str(f.name), "<invalid string index>");
    EXPECT_NE(p.Str(f.system_name), "<invalid string index>");
    EXPECT_NE(p.Str(f.filename), "<invalid string index>");
  }
  // A process's mappings are its own, and it has one location per address: a mapped address is
  // one location. (Unmapped ones may repeat across processes.)
  std::set<std::pair<uint64_t, uint64_t>> mapped_addresses;
  for (const Location &l : p.locations) {
    EXPECT_NE(l.id, 0u);
    EXPECT_TRUE(location_ids.insert(l.id).second) << "duplicate location id " << l.id;
    // Profile ingesters refuse a location without a mapping.
    const perftools_profiles_Mapping *m = p.FindMapping(l.mapping_id);
    ASSERT_NE(m, nullptr) << "location " << l.id << " has no mapping or an unknown one";
    if (p.Str(m->filename) != HD_PPROF_UNMAPPED) {
      EXPECT_GE(l.address, m->memory_start);
      EXPECT_LT(l.address, m->memory_limit);
      EXPECT_TRUE(mapped_addresses.emplace(l.mapping_id, l.address).second)
          << "two locations for 0x" << std::hex << l.address;
    }
    for (const Line &line : l.lines) {
      EXPECT_NE(p.FindFunction(line.function_id), nullptr)
          << "location " << l.id << " has an unknown function";
    }
  }
  for (const Sample &s : p.samples) {
    EXPECT_EQ(s.values.size(), types.size());
    for (uint64_t id : s.location_ids) EXPECT_EQ(location_ids.count(id), 1u) << "location " << id;
    for (const Label &l : s.labels) {
      EXPECT_NE(p.Str(l.key), "<invalid string index>");
      EXPECT_NE(p.Str(l.str), "<invalid string index>");
      EXPECT_NE(p.Str(l.num_unit), "<invalid string index>");
    }
  }
  for (int64_t c : p.comments) EXPECT_NE(p.Str(c), "<invalid string index>");
}

using Values = std::vector<int64_t>;

// Sample values per stack (program addresses, leaf first), summed over the samples.
std::map<std::vector<uint64_t>, Values> ValuesByStack(const Profile &p) {
  std::map<std::vector<uint64_t>, Values> out;
  for (const Sample &s : p.samples) {
    Values &v = out[p.Stack(s)];
    v.resize(4);
    for (size_t i = 0; i < 4 && i < s.values.size(); i++) v[i] += s.values[i];
  }
  return out;
}

// ---- go tool pprof ----

struct Go {
  std::string go;    // the go command, "" if not installed
  std::string home;  // HOME and GOCACHE for it
  Go() {
    for (const char *candidate : {"go", "/usr/lib/go/bin/go"}) {
      std::string probe = std::string("command -v ") + candidate + " >/dev/null 2>&1";
      if (system(probe.c_str()) == 0) {
        go = candidate;
        break;
      }
    }
    home = TempDir();
  }
  ~Go() {
    if (!home.empty()) {
      std::string cleanup = "rm -rf " + home;
      EXPECT_EQ(system(cleanup.c_str()), 0);
    }
  }
  struct Output {
    int status = -1;
    std::string out, err;
  };
  // Runs `go tool pprof ARGS PROFILE`; stdout and stderr apart, since pprof warns on stderr.
  Output Pprof(const std::string &args, const std::string &profile) const {
    Output o;
    std::string err_path = home + "/stderr";
    std::string command = "HOME=" + home + " GOCACHE=" + home + "/cache GOFLAGS= " + go +
                          " tool pprof " + args + " " + profile + " 2>" + err_path + " </dev/null";
    FILE *p = popen(command.c_str(), "r");
    if (p == nullptr) return o;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) o.out.append(buf, n);
    int status = pclose(p);
    o.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    o.err = ReadFile(err_path);
    return o;
  }
};

// `go tool pprof -raw` output, parsed: the samples (values and location ids), the locations
// (address, mapping, function names innermost first) and the mappings.
struct RawProfile {
  std::vector<std::string> sample_types;
  std::vector<std::pair<Values, std::vector<uint64_t>>> samples;
  struct Loc {
    uint64_t address = 0;
    uint64_t mapping = 0;
    std::vector<std::string> functions;
  };
  std::map<uint64_t, Loc> locations;
  std::vector<std::string> mapping_lines;

  Values Total() const {
    Values total(sample_types.size());
    for (const auto &s : samples) {
      for (size_t i = 0; i < total.size() && i < s.first.size(); i++) total[i] += s.first[i];
    }
    return total;
  }
  std::vector<uint64_t> Addresses(const std::vector<uint64_t> &ids) const {
    std::vector<uint64_t> out;
    for (uint64_t id : ids) {
      auto it = locations.find(id);
      out.push_back(it != locations.end() ? it->second.address : 0);
    }
    return out;
  }
  // The same, of the four sample types every heap profile has (a snapshot with a peak mark adds
  // two more).
  Values HeapValuesWith(const std::string &function) const {
    Values all = ValuesWith(function);
    all.resize(4);
    return all;
  }
  // Summed values of the samples having a frame (inlined or not) in function.
  Values ValuesWith(const std::string &function) const {
    Values total(sample_types.size());
    for (const auto &s : samples) {
      bool found = false;
      for (uint64_t id : s.second) {
        auto it = locations.find(id);
        if (it == locations.end()) continue;
        for (const auto &f : it->second.functions) found |= f == function;
      }
      if (!found) continue;
      for (size_t i = 0; i < total.size() && i < s.first.size(); i++) total[i] += s.first[i];
    }
    return total;
  }
};

// The integers of text, if it is nothing but integers separated by blanks.
bool Integers(const std::string &text, std::vector<int64_t> *out) {
  std::istringstream in(text);
  int64_t value;
  while (in >> value) out->push_back(value);
  return in.eof();
}

// A sample line: "VALUE... : LOCATION_ID...".
bool ParseSampleLine(const std::string &line, Values *values, std::vector<uint64_t> *ids) {
  size_t colon = line.find(':');
  std::vector<int64_t> location_ids;
  if (colon == std::string::npos || !Integers(line.substr(0, colon), values) || values->empty() ||
      !Integers(line.substr(colon + 1), &location_ids)) {
    return false;
  }
  ids->assign(location_ids.begin(), location_ids.end());
  return true;
}

// A location line: "ID: 0xADDRESS [M=MAPPING] [FUNCTION FILE:LINE s=START]".
bool ParseLocationLine(const std::string &line, uint64_t *id, RawProfile::Loc *loc) {
  std::istringstream in(line);
  std::string id_word, address, word;
  if (!(in >> id_word >> address) || id_word.back() != ':' || address.rfind("0x", 0) != 0) {
    return false;
  }
  *id = std::stoull(id_word.substr(0, id_word.size() - 1));
  loc->address = std::stoull(address, nullptr, 16);
  if (!(in >> word)) return true;
  if (word.rfind("M=", 0) == 0) {
    loc->mapping = std::stoull(word.substr(2));
    if (!(in >> word)) return true;
  }
  loc->functions.push_back(word);
  return true;
}

RawProfile ParseRaw(const std::string &text) {
  RawProfile raw;
  std::istringstream in(text);
  std::string line;
  enum { kNone, kSamples, kLocations, kMappings } section = kNone;
  RawProfile::Loc *current = nullptr;
  while (std::getline(in, line)) {
    if (line.rfind("Samples:", 0) == 0) {
      section = kSamples;
      continue;
    }
    if (line.rfind("Locations", 0) == 0) {
      section = kLocations;
      continue;
    }
    if (line.rfind("Mappings", 0) == 0) {
      section = kMappings;
      continue;
    }
    switch (section) {
      case kSamples: {
        Values values;
        std::vector<uint64_t> ids;
        if (raw.sample_types.empty()) {
          std::istringstream words(line);
          std::string word;
          while (words >> word) {
            raw.sample_types.push_back(word.substr(0, word.find("[dflt]")));
          }
        } else if (ParseSampleLine(line, &values, &ids)) {
          raw.samples.emplace_back(values, ids);
        }
        break;
      }
      case kLocations: {
        uint64_t id = 0;
        RawProfile::Loc loc;
        size_t indent = line.find_first_not_of(' ');
        if (ParseLocationLine(line, &id, &loc)) {
          current = &raw.locations[id];
          *current = loc;
        } else if (current != nullptr && indent != std::string::npos && indent >= 10) {
          // An inlined caller of the location above: "FUNCTION FILE:LINE s=START".
          current->functions.push_back(line.substr(indent, line.find(' ', indent) - indent));
        }
        break;
      }
      case kMappings:
        if (!line.empty()) raw.mapping_lines.push_back(line);
        break;
      case kNone: break;
    }
  }
  return raw;
}

// The word of text between before and after ("" if absent).
std::string Between(const std::string &text, const std::string &before, const std::string &after) {
  size_t start = text.find(before);
  if (start == std::string::npos) return "";
  start += before.size();
  size_t end = text.find(after, start);
  return end == std::string::npos ? "" : text.substr(start, end - start);
}

// The "N total" of `go tool pprof -top`'s header, as printed (e.g. "1208B", "16").
std::string TopTotal(const std::string &top) { return Between(top, "% of ", " total"); }

// What the shown nodes of `go tool pprof -top` account for: the total after tag filters.
std::string TopShown(const std::string &top) { return Between(top, "accounting for ", ","); }

// ---- a snapshot with everything the writer maps ----

constexpr uint64_t kProgram = 0x400000, kLibrary = 0x7f0000000000, kNowhere = 0x900000;
const std::vector<uint8_t> kBuildId = {0xde, 0xad, 0xbe, 0xef, 0x00, 0x01, 0x02, 0x03, 0x04, 0x05,
                                       0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f};

// Stacks (leaf first): 1 and 2 share their leaf; 3 ends outside every region; 4's blocks were all
// freed; 5 is empty (an unwinder that found no frame) and has only counters. In the profile, an
// empty stack is the one location that stands for "no stack", at address 0.
const std::vector<uint64_t> kStack1 = {kProgram + 0x100, kProgram + 0x200, kLibrary + 0x100};
const std::vector<uint64_t> kStack2 = {kProgram + 0x100, kProgram + 0x300};
const std::vector<uint64_t> kStack3 = {kLibrary + 0x200, kNowhere};
const std::vector<uint64_t> kStack4 = {kProgram + 0x400};
const std::vector<uint64_t> kStack5 = {};
const std::vector<uint64_t> kNoStack = {0};

void FillSnapshot(Stream &s, uint64_t address_offset = 0) {
  s.Region(kProgram, 0x10000, 0x1000, "/opt/example/bin/prog", kBuildId);
  s.Region(kLibrary, 0x20000, 0, "/opt/example/lib/libfoo.so", {});
  s.Thread(1, 100, "main");
  s.Thread(2, 101, "worker");
  s.Trace(1, kStack1);
  s.Trace(2, kStack2);
  s.Trace(3, kStack3);
  s.Trace(4, kStack4);
  s.Trace(5, kStack5);
  uint64_t a = 0x10000000 + address_offset;
  s.Allocation(a + 0x000, 100, 1, 1, 1000);
  s.Allocation(a + 0x100, 100, 1, 2, 2000);
  s.Allocation(a + 0x200, 100, 1, 1, 3000);
  s.Allocation(a + 0x300, 50, 2, 2, 4000, 2);  // two blocks aggregated into one element
  s.Allocation(a + 0x400, 7, 3, 1, 5000);
  s.Counters(1, 5, 500);
  s.Counters(2, 4, 100);
  s.Counters(4, 6, 600);
  s.Counters(5, 1, 8);
}

// Per stack: inuse_objects, inuse_space, alloc_objects, alloc_space.
const std::map<std::vector<uint64_t>, Values> kExpected = {
    {kStack1, {3, 300, 5, 500}}, {kStack2, {2, 50, 4, 100}}, {kStack3, {1, 7, 0, 0}},
    {kStack4, {0, 0, 6, 600}},   {kNoStack, {0, 0, 1, 8}},
};
const Values kExpectedTotal = {6, 357, 16, 1208};

class PprofTest : public ::testing::Test {
 protected:
  std::string dir = TempDir();
  Go go;
  std::string Path(const char *name) const { return dir + "/" + name; }
  void TearDown() override {
    std::string cleanup = "rm -rf " + dir;
    EXPECT_EQ(system(cleanup.c_str()), 0);
  }
};

TEST_F(PprofTest, OneSamplePerStackTraceWithLiveAndCumulativeValues) {
  Stream s;
  FillSnapshot(s);
  s.Finish();
  hd_pprof_options options = {};
  std::string path = Path("heap.pb.gz");
  WriteResult w = WriteProfile(&s.r, options, path);
  ASSERT_EQ(w.rc, 0) << w.error;
  Profile p;
  ASSERT_TRUE(Load(path, &p));
  ExpectWellFormed(p);
  EXPECT_EQ(p.Str(p.scalars.default_sample_type), "inuse_space");
  EXPECT_EQ(p.samples.size(), kExpected.size());
  EXPECT_EQ(ValuesByStack(p), kExpected);
  for (const Sample &sample : p.samples) EXPECT_TRUE(sample.labels.empty());
  EXPECT_TRUE(p.comments.empty());

  // One location per distinct address, with its real address and the mapping of its region.
  std::set<uint64_t> distinct;
  for (const auto &[stack, values] : kExpected) distinct.insert(stack.begin(), stack.end());
  ASSERT_EQ(p.locations.size(), distinct.size());
  ASSERT_EQ(p.mappings.size(), 3u);  // the program, the library, and the unmapped locations'
  ASSERT_EQ(p.functions.size(), 1u);
  EXPECT_EQ(p.Str(p.functions[0].name), "(no stack)");
  const perftools_profiles_Mapping &unmapped = p.mappings[2];
  EXPECT_EQ(p.Str(unmapped.filename), HD_PPROF_UNMAPPED);
  EXPECT_EQ(unmapped.memory_start, 0u);
  EXPECT_EQ(unmapped.memory_limit, 0u);
  EXPECT_TRUE(unmapped.has_functions);
  for (const Location &l : p.locations) {
    EXPECT_TRUE(distinct.count(l.address)) << std::hex << l.address;
    const perftools_profiles_Mapping *m = p.FindMapping(l.mapping_id);
    if (l.address == 0) {
      EXPECT_EQ(l.mapping_id, unmapped.id);
      ASSERT_EQ(l.lines.size(), 1u);
      EXPECT_EQ(l.lines[0].function_id, p.functions[0].id);
      continue;
    }
    EXPECT_TRUE(l.lines.empty());
    if (l.address == kNowhere) {
      EXPECT_EQ(l.mapping_id, unmapped.id);
    } else {
      ASSERT_NE(m, nullptr);
      EXPECT_EQ(m->memory_start, l.address >= kLibrary ? kLibrary : kProgram);
    }
  }
  const perftools_profiles_Mapping &program = p.mappings[0], &library = p.mappings[1];
  EXPECT_EQ(program.memory_start, kProgram);
  EXPECT_EQ(program.memory_limit, kProgram + 0x10000);
  EXPECT_EQ(program.file_offset, 0x1000u);
  EXPECT_EQ(p.Str(program.filename), "/opt/example/bin/prog");
  EXPECT_EQ(p.Str(program.build_id), "deadbeef000102030405060708090a0b0c0d0e0f");
  EXPECT_EQ(library.memory_limit, kLibrary + 0x20000);
  EXPECT_EQ(p.Str(library.filename), "/opt/example/lib/libfoo.so");
  EXPECT_EQ(p.Str(library.build_id), "");
  for (const auto &m : {program, library}) {
    EXPECT_FALSE(m.has_functions || m.has_filenames || m.has_line_numbers || m.has_inline_frames);
  }

  if (go.go.empty()) GTEST_SKIP() << "go not found: install golang-go to check with go tool pprof";
  auto raw_out = go.Pprof("-raw -symbolize=none", path);
  ASSERT_EQ(raw_out.status, 0) << raw_out.err;
  RawProfile raw = ParseRaw(raw_out.out);
  EXPECT_EQ(raw.sample_types, kSampleTypes) << raw_out.out;
  EXPECT_EQ(raw.Total(), kExpectedTotal) << raw_out.out;
  std::map<std::vector<uint64_t>, Values> by_stack;
  for (const auto &[values, ids] : raw.samples) by_stack[raw.Addresses(ids)] = values;
  EXPECT_EQ(by_stack, kExpected) << raw_out.out;
  bool build_id_shown = false;
  for (const auto &m : raw.mapping_lines) {
    build_id_shown |= m.find("deadbeef000102030405060708090a0b0c0d0e0f") != std::string::npos;
  }
  EXPECT_TRUE(build_id_shown) << raw_out.out;

  // Each sample index gives its own total; the default is inuse_space.
  const std::map<std::string, std::string> totals = {{"", "357B"},
                                                     {"-sample_index=inuse_space", "357B"},
                                                     {"-sample_index=inuse_objects", "6"},
                                                     {"-sample_index=alloc_space", "1208B"},
                                                     {"-sample_index=alloc_objects", "16"}};
  for (const auto &[flag, total] : totals) {
    auto top = go.Pprof("-top -symbolize=none " + flag, path);
    ASSERT_EQ(top.status, 0) << flag << ": " << top.err;
    EXPECT_EQ(TopTotal(top.out), total) << flag << ":\n" << top.out;
  }
  auto traces = go.Pprof("-traces -symbolize=none", path);
  ASSERT_EQ(traces.status, 0) << traces.err;
  EXPECT_NE(traces.out.find("libfoo.so"), std::string::npos) << traces.out;
  EXPECT_NE(traces.out.find("prog"), std::string::npos) << traces.out;
}

// A trace cut at the frame limit ends at its root in a location saying so, with no address or
// mapping, shared by every trace cut at the same count; whole traces get none.
TEST_F(PprofTest, TruncatedTracesEndInAMarkerLocation) {
  Stream s;
  s.Region(kProgram, 0x10000, 0x1000, "/opt/example/bin/prog", kBuildId);
  s.Thread(1, 100, "main");
  s.Trace(1, kStack1, 2, /*truncated=*/true);
  s.Trace(2, {kProgram + 0x500, kProgram + 0x600, kProgram + 0x700}, 1, /*truncated=*/true);
  s.Trace(3, kStack2);
  s.Allocation(0x10000000, 100, 1, 1, 1000);
  s.Allocation(0x10000100, 200, 2, 1, 2000);
  s.Allocation(0x10000200, 300, 3, 1, 3000);
  s.Finish();
  std::string path = Path("cut.pb.gz");
  WriteResult w = WriteProfile(&s.r, hd_pprof_options{}, path);
  ASSERT_EQ(w.rc, 0) << w.error;
  Profile p;
  ASSERT_TRUE(Load(path, &p));
  ExpectWellFormed(p);
  ASSERT_EQ(p.samples.size(), 3u);
  uint64_t marker = 0;
  for (const Sample &sample : p.samples) {
    ASSERT_FALSE(sample.location_ids.empty());
    const Location *root = p.FindLocation(sample.location_ids.back());
    ASSERT_NE(root, nullptr);
    if (sample.values[1] == 300) {  // the whole trace
      EXPECT_EQ(sample.location_ids.size(), kStack2.size());
      EXPECT_NE(root->address, 0u);
      continue;
    }
    EXPECT_EQ(sample.location_ids.size(), 4u);
    EXPECT_EQ(root->address, 0u);
    EXPECT_EQ(p.Str(p.FindMapping(root->mapping_id)->filename), HD_PPROF_UNMAPPED);
    ASSERT_EQ(root->lines.size(), 1u);
    const perftools_profiles_Function *f = p.FindFunction(root->lines[0].function_id);
    ASSERT_NE(f, nullptr);
    EXPECT_EQ(p.Str(f->name), "... truncated at 3 frames");
    if (marker == 0) marker = root->id;
    EXPECT_EQ(root->id, marker) << "traces cut at one count share their marker";
  }
}

TEST_F(PprofTest, DefaultSampleTypeIsTheChosenOne) {
  Stream s;
  FillSnapshot(s);
  s.Finish();
  const std::map<hd_pprof_sample, std::pair<std::string, std::string>> choices = {
      {HD_PPROF_INUSE_SPACE, {"inuse_space", "357B"}},
      {HD_PPROF_INUSE_OBJECTS, {"inuse_objects", "6"}},
      {HD_PPROF_ALLOC_SPACE, {"alloc_space", "1208B"}},
      {HD_PPROF_ALLOC_OBJECTS, {"alloc_objects", "16"}},
  };
  for (const auto &[choice, expected] : choices) {
    hd_pprof_options options = {};
    options.default_sample = choice;
    std::string path = Path(("heap-" + expected.first + ".pb.gz").c_str());
    WriteResult w = WriteProfile(&s.r, options, path);
    ASSERT_EQ(w.rc, 0) << w.error;
    Profile p;
    ASSERT_TRUE(Load(path, &p));
    EXPECT_EQ(p.Str(p.scalars.default_sample_type), expected.first);
    if (go.go.empty()) continue;
    auto top = go.Pprof("-top -symbolize=none", path);
    ASSERT_EQ(top.status, 0) << top.err;
    EXPECT_EQ(TopTotal(top.out), expected.second) << expected.first << ":\n" << top.out;
  }
  if (go.go.empty()) GTEST_SKIP() << "go not found: install golang-go to check with go tool pprof";
}

// What a /debug/pprof/heap endpoint serves: Go's order of the sample types, the same values.
TEST_F(PprofTest, GoOrderPutsTheCumulativeTypesFirst) {
  Stream s;
  FillSnapshot(s);
  s.Finish();
  hd_pprof_options options = {};
  options.go_order = true;
  std::string path = Path("go.pb.gz");
  WriteResult w = WriteProfile(&s.r, options, path);
  ASSERT_EQ(w.rc, 0) << w.error;
  Profile p;
  ASSERT_TRUE(Load(path, &p));
  EXPECT_EQ(p.SampleTypes(),
            (std::vector<std::string>{"alloc_objects/count", "alloc_space/bytes",
                                      "inuse_objects/count", "inuse_space/bytes"}));
  EXPECT_EQ(p.Str(p.scalars.default_sample_type), "inuse_space");
  std::map<std::vector<uint64_t>, Values> expected;
  for (const auto &[stack, v] : kExpected) expected[stack] = {v[2], v[3], v[0], v[1]};
  EXPECT_EQ(ValuesByStack(p), expected);
}

TEST_F(PprofTest, TagsGiveOneSamplePerBlockWithItsLabels) {
  Stream s;
  FillSnapshot(s);
  s.Finish();
  hd_pprof_options options = {};
  options.tags = true;
  std::string path = Path("tags.pb.gz");
  WriteResult w = WriteProfile(&s.r, options, path);
  ASSERT_EQ(w.rc, 0) << w.error;
  Profile p;
  ASSERT_TRUE(Load(path, &p));
  ExpectWellFormed(p);
  // One sample per allocation element, plus one per stack trace with cumulative counters.
  EXPECT_EQ(p.samples.size(), 5u + 4u);
  EXPECT_EQ(ValuesByStack(p), kExpected);
  size_t blocks = 0;
  for (const Sample &sample : p.samples) {
    auto labels = p.Labels(sample);
    if (sample.values[0] == 0) {
      EXPECT_TRUE(labels.empty()) << "counters are per stack trace, not per block";
      continue;
    }
    blocks++;
    EXPECT_EQ(labels.size(), 4u);
    EXPECT_EQ(labels["bytes"], std::to_string(sample.values[1]));
    for (const Label &l : sample.labels) {
      const std::string &key = p.Str(l.key);
      const std::map<std::string, std::string> units = {
          {"bytes", "bytes"}, {"timestamp", "nanoseconds"}, {"thread", ""}, {"address", ""}};
      EXPECT_EQ(p.Str(l.num_unit), units.at(key)) << key;
    }
    uint64_t address = std::stoull(labels["address"]);
    const std::map<uint64_t, std::tuple<std::string, std::string, std::vector<uint64_t>>> known = {
        {0x10000000, {"1000", "main[100]", kStack1}},
        {0x10000100, {"2000", "worker[101]", kStack1}},
        {0x10000200, {"3000", "main[100]", kStack1}},
        {0x10000300, {"4000", "worker[101]", kStack2}},
        {0x10000400, {"5000", "main[100]", kStack3}},
    };
    auto it = known.find(address);
    ASSERT_NE(it, known.end()) << std::hex << address;
    EXPECT_EQ(labels["timestamp"], std::get<0>(it->second));
    EXPECT_EQ(labels["thread"], std::get<1>(it->second));
    EXPECT_EQ(p.Stack(sample), std::get<2>(it->second));
  }
  EXPECT_EQ(blocks, 5u);

  if (go.go.empty()) GTEST_SKIP() << "go not found: install golang-go to check with go tool pprof";
  auto tags = go.Pprof("-tags -symbolize=none -sample_index=inuse_objects", path);
  ASSERT_EQ(tags.status, 0) << tags.err;
  for (const char *expected : {"thread:", "main[100]", "worker[101]",
                               "address:", "timestamp:", "bytes:", "100B", "50B", "7B"}) {
    EXPECT_NE(tags.out.find(expected), std::string::npos) << expected << " in\n" << tags.out;
  }
  auto raw_out = go.Pprof("-raw -symbolize=none", path);
  ASSERT_EQ(raw_out.status, 0) << raw_out.err;
  RawProfile raw = ParseRaw(raw_out.out);
  EXPECT_EQ(raw.Total(), kExpectedTotal) << raw_out.out;
  // Focusing on one thread keeps its blocks only.
  auto worker =
      go.Pprof("-top -symbolize=none -sample_index=inuse_space -tagfocus=thread=worker", path);
  ASSERT_EQ(worker.status, 0) << worker.err;
  EXPECT_EQ(TopShown(worker.out), "150B") << worker.out;
}

TEST_F(PprofTest, MultiProcessSamplesAreLabelledWithTheirProcess) {
  Stream s;
  s.Header("first", 4242);
  FillSnapshot(s);
  s.Header("second", 4343);
  FillSnapshot(s, 0x100000);
  s.Finish();
  ASSERT_EQ(s.r.snapshot_count, 2u);
  for (bool tags : {false, true}) {
    hd_pprof_options options = {};
    options.tags = tags;
    std::string path = Path(tags ? "multi-tags.pb.gz" : "multi.pb.gz");
    WriteResult w = WriteProfile(&s.r, options, path);
    ASSERT_EQ(w.rc, 0) << w.error;
    Profile p;
    ASSERT_TRUE(Load(path, &p));
    ExpectWellFormed(p);
    // Each process has its own mappings and locations, even at the same addresses; the "no stack"
    // location has the unmapped locations' mapping.
    EXPECT_EQ(p.mappings.size(), 5u);
    EXPECT_EQ(p.locations.size(), 2u * 7u + 1u);  // and one stands for "no stack" in both
    std::map<std::string, Values> by_process;
    for (const Sample &sample : p.samples) {
      auto labels = p.Labels(sample);
      std::string process = labels["process_name"] + "/" + labels["pid"];
      Values &v = by_process[process];
      v.resize(4);
      for (size_t i = 0; i < 4; i++) v[i] += sample.values[i];
      uint64_t mapping = 0;
      for (uint64_t id : sample.location_ids) {
        const Location *l = p.FindLocation(id);
        if (p.Str(p.FindMapping(l->mapping_id)->filename) != HD_PPROF_UNMAPPED) {
          mapping = l->mapping_id;
        }
      }
      if (mapping != 0) {
        EXPECT_EQ(mapping <= 2, process == "first/4242")
            << "a sample uses another process's mappings";
      }
    }
    EXPECT_EQ(by_process, (std::map<std::string, Values>{{"first/4242", kExpectedTotal},
                                                         {"second/4343", kExpectedTotal}}));
    if (go.go.empty()) continue;
    auto tags_out = go.Pprof("-tags -symbolize=none", path);
    ASSERT_EQ(tags_out.status, 0) << tags_out.err;
    for (const char *expected : {"process_name:", "first", "second", "pid:", "4242", "4343"}) {
      EXPECT_NE(tags_out.out.find(expected), std::string::npos) << expected << " in\n"
                                                                << tags_out.out;
    }
    auto second = go.Pprof("-top -symbolize=none -tagfocus=process_name=second", path);
    ASSERT_EQ(second.status, 0) << second.err;
    EXPECT_EQ(TopShown(second.out), "357B") << second.out;
  }
  if (go.go.empty()) GTEST_SKIP() << "go not found: install golang-go to check with go tool pprof";
}

TEST_F(PprofTest, DroppedRecordsBecomeAComment) {
  Stream s;
  FillSnapshot(s);
  s.DroppedRecords(3, 2, 1);
  s.Finish();
  std::string path = Path("dropped.pb.gz");
  WriteResult w = WriteProfile(&s.r, hd_pprof_options{}, path);
  ASSERT_EQ(w.rc, 0) << w.error;
  Profile p;
  ASSERT_TRUE(Load(path, &p));
  ExpectWellFormed(p);
  ASSERT_EQ(p.comments.size(), 1u);
  const std::string &comment = p.Str(p.comments[0]);
  EXPECT_NE(comment.find("3 allocations, 2 stack traces and 1 other records"), std::string::npos)
      << comment;
  if (go.go.empty()) GTEST_SKIP() << "go not found: install golang-go to check with go tool pprof";
  auto out = go.Pprof("-comments", path);
  ASSERT_EQ(out.status, 0) << out.err;
  EXPECT_NE(out.out.find(comment), std::string::npos) << out.out;
}

// The bytes an armed process held from before it was armed (no stack trace is known for them)
// are a sample of their own, at a stand-in frame naming them, so that the profile's inuse_space
// total is the process's; reading the profile back leaves that sample out (no blocks of it are
// known) rather than making it an allocation without a stack.
TEST_F(PprofTest, UnattributedBytesOfAnArmedProcessAreASampleOfTheirOwn) {
  Stream s;
  FillSnapshot(s);
  s.Unattributed(5000);
  s.Finish();
  std::string path = Path("armed.pb.gz");
  WriteResult w = WriteProfile(&s.r, hd_pprof_options{}, path);
  ASSERT_EQ(w.rc, 0) << w.error;
  Profile p;
  ASSERT_TRUE(Load(path, &p));
  ExpectWellFormed(p);
  ASSERT_EQ(p.samples.size(), kExpected.size() + 1);
  size_t found = 0;
  int64_t space = 0;
  for (const Sample &sample : p.samples) {
    space += sample.values[1];
    if (sample.location_ids.size() != 1) continue;
    const Location *l = p.FindLocation(sample.location_ids[0]);
    ASSERT_NE(l, nullptr);
    if (l->lines.size() != 1 ||
        p.Str(p.FindFunction(l->lines[0].function_id)->name) != HD_UNATTRIBUTED_FRAME) {
      continue;
    }
    found++;
    EXPECT_EQ(l->address, 0u);
    EXPECT_EQ(sample.values, (Values{0, 5000, 0, 0}));
  }
  EXPECT_EQ(found, 1u);
  EXPECT_EQ(space, 357 + 5000);
  ASSERT_EQ(p.comments.size(), 1u);
  EXPECT_NE(p.Str(p.comments[0])
                .find("5000 more live bytes (glibc's count, headers included) are in the sample " +
                      std::string(HD_UNATTRIBUTED_FRAME)),
            std::string::npos)
      << p.Str(p.comments[0]);

  const std::string bytes = hdtest::ReadFile(path);
  hd_reassembler r;
  hd_reassembler_init(&r);
  char error[256] = "";
  ASSERT_EQ(hd_pprof_read(reinterpret_cast<const uint8_t *>(bytes.data()), bytes.size(), "armed", 1,
                          &r, error, sizeof error),
            0)
      << error;
  ASSERT_EQ(r.snapshot_count, 1u);
  uint64_t read_space = 0;
  for (size_t i = 0; i < r.snapshots[0]->allocation_count; i++)
    read_space += r.snapshots[0]->allocations[i].size;
  EXPECT_EQ(read_space, 357u);
  hd_reassembler_destroy(&r);

  // A profile of values per trace (as a diff's) has no such sample, and its comment says so.
  hd_pprof_options per_trace = {};
  per_trace.trace_values = [](void *, size_t, size_t, int64_t values[4]) {
    values[0] = values[2] = values[3] = 0;
    values[1] = 1;
    return true;
  };
  const std::string diff_path = Path("per-trace.pb.gz");
  WriteResult d = WriteProfile(&s.r, per_trace, diff_path);
  ASSERT_EQ(d.rc, 0) << d.error;
  Profile dp;
  ASSERT_TRUE(Load(diff_path, &dp));
  int64_t diff_space = 0;
  for (const Sample &sample : dp.samples) diff_space += sample.values[1];
  EXPECT_EQ(diff_space, static_cast<int64_t>(dp.samples.size()));
  ASSERT_EQ(dp.comments.size(), 1u);
  EXPECT_NE(dp.Str(dp.comments[0]).find("headers included) are in none"), std::string::npos)
      << dp.Str(dp.comments[0]);

  if (go.go.empty()) GTEST_SKIP() << "go not found: install golang-go to check with go tool pprof";
  auto top = go.Pprof("-top -symbolize=none", path);
  ASSERT_EQ(top.status, 0) << top.err;
  EXPECT_EQ(TopTotal(top.out), "5357B") << top.out;
  EXPECT_NE(top.out.find(HD_UNATTRIBUTED_FRAME), std::string::npos) << top.out;
}

TEST_F(PprofTest, EmptySnapshotGivesAValidEmptyProfile) {
  Stream s;
  heapdump_client_SnapshotElement unknown = heapdump_client_SnapshotElement_init_zero;
  s.Add(unknown);  // an element of a variant this version skips: the snapshot exists, empty
  s.Finish();
  std::string path = Path("empty.pb.gz");
  WriteResult w = WriteProfile(&s.r, hd_pprof_options{}, path);
  ASSERT_EQ(w.rc, 0) << w.error;
  Profile p;
  ASSERT_TRUE(Load(path, &p));
  ExpectWellFormed(p);
  EXPECT_TRUE(p.samples.empty());
  if (go.go.empty()) GTEST_SKIP() << "go not found: install golang-go to check with go tool pprof";
  auto top = go.Pprof("-top -symbolize=none", path);
  EXPECT_EQ(top.status, 0) << top.err;
}

// A gzip bomb given as a profile: refused once it inflates past a hundred times its size (64 MiB
// for a small one), with a message, instead of filling memory.
TEST(PprofReadTest, AGzipBombIsRefusedAtItsLimit) {
  std::string bomb;
  z_stream z = {};
  ASSERT_EQ(deflateInit2(&z, 9, Z_DEFLATED, 16 + MAX_WBITS, 9, Z_DEFAULT_STRATEGY), Z_OK);
  std::vector<uint8_t> zeros(1 << 20), out(1 << 16);
  for (int mib = 0; mib < 256; mib++) {  // 256 MiB of zeros, about 256 KiB compressed
    z.next_in = zeros.data();
    z.avail_in = static_cast<uInt>(zeros.size());
    const int flush = mib == 255 ? Z_FINISH : Z_NO_FLUSH;
    do {
      z.next_out = out.data();
      z.avail_out = static_cast<uInt>(out.size());
      deflate(&z, flush);
      bomb.append(reinterpret_cast<char *>(out.data()), out.size() - z.avail_out);
    } while (z.avail_out == 0 || (flush == Z_FINISH && z.avail_in > 0));
  }
  deflateEnd(&z);
  ASSERT_LT(bomb.size(), 1u << 20);
  hd_reassembler r;
  hd_reassembler_init(&r);
  char error[256] = "";
  EXPECT_EQ(hd_pprof_read(reinterpret_cast<const uint8_t *>(bomb.data()), bomb.size(), "bomb", 1,
                          &r, error, sizeof error),
            -EFBIG);
  EXPECT_NE(std::string(error).find("inflates to more than 64 MiB"), std::string::npos) << error;
  hd_reassembler_destroy(&r);
}

TEST_F(PprofTest, ErrorsAreReportedWithAMessage) {
  Stream s;
  FillSnapshot(s);
  s.Finish();
  char error[256];

  // A full disk.
  FILE *full = fopen("/dev/full", "w");
  ASSERT_NE(full, nullptr);
  EXPECT_EQ(hd_pprof_write(&s.r, nullptr, full, error, sizeof error), -ENOSPC);
  EXPECT_NE(std::string(error).find("No space left on device"), std::string::npos) << error;
  fclose(full);

  // A stream that cannot be written to.
  std::string path = Path("read-only");
  FILE *create = fopen(path.c_str(), "w");
  ASSERT_NE(create, nullptr);
  fclose(create);
  FILE *read_only = fopen(path.c_str(), "r");
  ASSERT_NE(read_only, nullptr);
  EXPECT_EQ(hd_pprof_write(&s.r, nullptr, read_only, error, sizeof error), -EBADF);
  EXPECT_NE(std::string(error).find("writing the profile"), std::string::npos) << error;
  fclose(read_only);

  // A sample type that does not exist.
  hd_pprof_options options = {};
  options.default_sample = static_cast<hd_pprof_sample>(7);
  FILE *out = fopen(Path("bad.pb.gz").c_str(), "w");
  ASSERT_NE(out, nullptr);
  EXPECT_EQ(hd_pprof_write(&s.r, &options, out, error, sizeof error), -EINVAL);
  EXPECT_NE(std::string(error).find("sample type"), std::string::npos) << error;

  // Allocations whose stack trace or thread never arrived (the stream was not finished).
  Stream dangling;
  dangling.Thread(1, 100, "main");
  dangling.Allocation(0x1000, 16, 77, 1, 0);
  EXPECT_EQ(hd_pprof_write(&dangling.r, nullptr, out, error, sizeof error), -EINVAL);
  EXPECT_NE(std::string(error).find("unknown stack trace 77"), std::string::npos) << error;
  Stream no_thread;
  no_thread.Trace(1, {0x400000});
  no_thread.Allocation(0x1000, 16, 1, 9, 0);
  options = {};
  options.tags = true;
  EXPECT_EQ(hd_pprof_write(&no_thread.r, &options, out, error, sizeof error), -EINVAL);
  EXPECT_NE(std::string(error).find("unknown thread 9"), std::string::npos) << error;

  EXPECT_EQ(hd_pprof_write(nullptr, nullptr, out, error, sizeof error), -EINVAL);
  EXPECT_EQ(hd_pprof_write(&s.r, nullptr, nullptr, error, sizeof error), -EINVAL);
  fclose(out);
}

// ---- real programs under LD_PRELOAD, a real collector ----

// A pprof_child under LD_PRELOAD, stopped at "ready" until Finish().
struct Child {
  hdtest::Program program;
  pid_t pid;
  explicit Child(const std::string &socket)
      : program({HD_CHILD}, hdtest::InstrumentedEnv(socket)), pid(program.pid) {
    EXPECT_EQ(program.ReadLine(), "ready " + std::to_string(pid));
  }
  void Finish() {
    if (program.pid <= 0) return;
    program.Send("go");
    int status = program.Finish();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
};

using hdtest::ByName;
using hdtest::ByPid;

// A live snapshot through the shared client (generated bindings), checked; r is what it
// reassembled.
struct LiveSnapshot {
  std::unique_ptr<hdtest::Result> result;
  hd_reassembler &r;
  LiveSnapshot(const std::string &socket, const heapdump_client_ProcessSelector &selector,
               bool multi_process)
      : result(hdtest::TakeLiveSnapshot(socket, &selector, false, multi_process)), r(result->ra) {
    EXPECT_EQ(result->status, HD_OK) << r.error;
    EXPECT_EQ(result->error, 0u);
  }
};

// The GNU build ID of an ELF file, as hex, from readelf.
std::string ElfBuildId(const char *path) {
  std::string command = std::string("readelf -n ") + path + " 2>/dev/null";
  FILE *p = popen(command.c_str(), "r");
  if (p == nullptr) return "";
  std::string text;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) text.append(buf, n);
  pclose(p);
  return Between(text, "Build ID: ", "\n");
}

// The 1-based number of the first line of a file that is exactly text; 0 if none is.
int64_t LineOf(const std::string &path, const std::string &text) {
  std::istringstream in(ReadFile(path));
  std::string line;
  for (int64_t number = 1; std::getline(in, line); number++) {
    if (line == text) return number;
  }
  return 0;
}

// The live totals of a snapshot: inuse_objects and inuse_space.
Values LiveTotals(const hd_snapshot *s) {
  Values v = {0, 0};
  for (size_t i = 0; i < s->allocation_count; i++) {
    v[0] += static_cast<int64_t>(s->allocations[i].count);
    v[1] += static_cast<int64_t>(s->allocations[i].size);
  }
  return v;
}

class LivePprofTest : public PprofTest {
 protected:
  Collector collector{dir};
  void SetUp() override { collector.Start(); }
  // Writes r as a symbolized profile to file `name` and reads it back, well formed, into p.
  void WriteSymbolized(const hd_reassembler *r, const char *name, Profile *p) {
    hd_symbolizer *symbolizer = nullptr;
    ASSERT_EQ(hd_symbolizer_create(nullptr, &symbolizer), 0);
    hd_pprof_options options = {};
    options.symbolizer = symbolizer;
    WriteResult w = WriteProfile(r, options, Path(name));
    hd_symbolizer_destroy(symbolizer);
    ASSERT_EQ(w.rc, 0) << w.error;
    ASSERT_TRUE(Load(Path(name), p));
    ExpectWellFormed(*p);
  }
};

// What pprof_child.c allocates, per function: inuse objects/bytes, alloc objects/bytes.
const std::map<std::string, Values> kChildSites = {
    {"alpha_leaks", {10, 1000, 10, 1000}}, {"worker_leaks", {5, 1000, 5, 1000}},
    {"inlined_block", {4, 1200, 4, 1200}}, {"inline_caller", {4, 1200, 4, 1200}},
    {"churn", {1, 700, 6, 4200}},
};

TEST_F(LivePprofTest, SymbolizedProfileOfARealProcess) {
  Child child(collector.socket);
  LiveSnapshot s(collector.socket, ByPid(child.pid), false);
  child.Finish();
  ASSERT_EQ(s.r.snapshot_count, 1u);
  const hd_snapshot *snap = s.r.snapshots[0];
  const std::string path = Path("live.pb.gz");
  Profile p;
  ASSERT_NO_FATAL_FAILURE(WriteSymbolized(&s.r, "live.pb.gz", &p));

  // Every sample total matches the snapshot, every stack trace is one sample.
  Values inuse = {0, 0};
  for (const Sample &sample : p.samples) {
    inuse[0] += sample.values[0];
    inuse[1] += sample.values[1];
  }
  EXPECT_EQ(inuse, LiveTotals(snap));

  // The child's mapping: its build ID, and symbols with files, lines and inlined frames.
  const perftools_profiles_Mapping *child_mapping = nullptr;
  for (const auto &m : p.mappings) {
    if (p.Str(m.filename).find("pprof_child") != std::string::npos && child_mapping == nullptr) {
      child_mapping = &m;
    }
  }
  ASSERT_NE(child_mapping, nullptr);
  EXPECT_EQ(p.Str(child_mapping->build_id), ElfBuildId(HD_CHILD));
  EXPECT_FALSE(p.Str(child_mapping->build_id).empty());
  EXPECT_TRUE(child_mapping->has_functions);
  EXPECT_TRUE(child_mapping->has_filenames);
  EXPECT_TRUE(child_mapping->has_line_numbers);
  EXPECT_TRUE(child_mapping->has_inline_frames);

  // The inlined allocation site: one location, two lines, the inlined function first.
  bool inlined_seen = false;
  for (const Location &l : p.locations) {
    std::vector<std::string> names;
    for (const Line &line : l.lines) {
      const perftools_profiles_Function *f = p.FindFunction(line.function_id);
      names.push_back(p.Str(f->name));
      if (names.back() == "alpha_leaks") {
        EXPECT_GT(line.line, 0);
        EXPECT_NE(p.Str(f->filename).find("pprof_child.c"), std::string::npos);
        EXPECT_EQ(p.Str(f->system_name), "alpha_leaks");
      }
    }
    if (!names.empty() && names[0] == "inlined_block") {
      inlined_seen = true;
      EXPECT_EQ(names, (std::vector<std::string>{"inlined_block", "inline_caller"}));
      EXPECT_EQ(l.mapping_id, child_mapping->id);
    }
  }
  EXPECT_TRUE(inlined_seen);

  // Callers are looked up as return addresses: main's frame is on the line of the call itself.
  size_t calls_checked = 0;
  for (const Sample &sample : p.samples) {
    if (sample.location_ids.size() < 2) continue;
    const Location *leaf = p.FindLocation(sample.location_ids[0]);
    const Location *caller = p.FindLocation(sample.location_ids[1]);
    if (leaf->lines.empty() ||
        p.Str(p.FindFunction(leaf->lines[0].function_id)->name) != "alpha_leaks") {
      continue;
    }
    ASSERT_FALSE(caller->lines.empty());
    const perftools_profiles_Function *f = p.FindFunction(caller->lines.back().function_id);
    EXPECT_EQ(p.Str(f->name), "main");
    EXPECT_EQ(caller->lines.back().line, LineOf(p.Str(f->filename), "  alpha_leaks();"));
    calls_checked++;
  }
  EXPECT_EQ(calls_checked, 1u);

  if (go.go.empty()) GTEST_SKIP() << "go not found: install golang-go to check with go tool pprof";
  auto raw_out = go.Pprof("-raw", path);
  ASSERT_EQ(raw_out.status, 0) << raw_out.err;
  RawProfile raw = ParseRaw(raw_out.out);
  Values total = raw.Total();
  ASSERT_GE(total.size(), 4u) << raw_out.out;
  EXPECT_EQ(Values(total.begin(), total.begin() + 2), LiveTotals(snap)) << raw_out.out;
  for (const auto &[function, values] : kChildSites) {
    EXPECT_EQ(raw.HeapValuesWith(function), values) << function << " in\n" << raw_out.out;
  }
  auto top = go.Pprof("-top -sample_index=alloc_space", path);
  ASSERT_EQ(top.status, 0) << top.err;
  EXPECT_NE(top.out.find("churn"), std::string::npos) << top.out;
  auto traces = go.Pprof("-traces -sample_index=inuse_space", path);
  ASSERT_EQ(traces.status, 0) << traces.err;
  for (const char *function :
       {"alpha_leaks", "worker_leaks", "inlined_block", "inline_caller", "main"}) {
    EXPECT_NE(traces.out.find(function), std::string::npos) << function << " in\n" << traces.out;
  }
}

// Without a symbolizer the profile has addresses only; the mappings (start, offset, file, build
// ID) are right if pprof can symbolize it itself from the ELF file.
// A C++ function is named as in the source, its linkage name kept as system_name (what tools
// that look symbols up need); no Function is left with a mangled name.
TEST_F(LivePprofTest, CxxFunctionsHaveReadableNamesAndKeepTheirLinkageNames) {
  hdtest::Program program({HD_SHOP_CHILD}, hdtest::InstrumentedEnv(collector.socket));
  ASSERT_EQ(program.ReadLine(), "ready " + std::to_string(program.pid));
  LiveSnapshot s(collector.socket, ByPid(program.pid), false);
  program.Send("go");
  EXPECT_EQ(program.Finish(), 0);
  Profile p;
  ASSERT_NO_FATAL_FAILURE(WriteSymbolized(&s.r, "shop.pb.gz", &p));
  bool found = false;
  for (const auto &f : p.functions) {
    const std::string name = p.Str(f.name), system_name = p.Str(f.system_name);
    if (system_name == "_ZN4shop11make_basketEi") {
      EXPECT_EQ(name, "shop::make_basket(int)");
      found = true;
    }
    if (system_name.rfind("_Z", 0) == 0) {
      EXPECT_NE(name.rfind("_Z", 0), 0u) << system_name;
    }
  }
  EXPECT_TRUE(found);
}

TEST_F(LivePprofTest, UnsymbolizedProfileIsSymbolizedByPprof) {
  Child child(collector.socket);
  LiveSnapshot s(collector.socket, ByPid(child.pid), false);
  child.Finish();
  std::string path = Path("addresses.pb.gz");
  WriteResult w = WriteProfile(&s.r, hd_pprof_options{}, path);
  ASSERT_EQ(w.rc, 0) << w.error;
  Profile p;
  ASSERT_TRUE(Load(path, &p));
  ExpectWellFormed(p);
  EXPECT_TRUE(p.functions.empty());
  // Location addresses are the snapshot's program addresses, from each trace's allocation site
  // on (without symbols, the site skips only modules: libheapdump and the C++ library's).
  std::set<uint64_t> addresses;
  const hd_snapshot *snap = s.r.snapshots[0];
  for (size_t i = 0; i < snap->stack_trace_count; i++) {
    const hd_snapshot_stack_trace &t = snap->stack_traces[i];
    addresses.insert(t.addresses + hd_site_frame(nullptr, snap, &t), t.addresses + t.count);
  }
  std::set<uint64_t> located;
  for (const Location &l : p.locations) located.insert(l.address);
  EXPECT_EQ(located, addresses);
  EXPECT_EQ(p.locations.size(), addresses.size()) << "an address has several locations";

  if (go.go.empty()) GTEST_SKIP() << "go not found: install golang-go to check with go tool pprof";
  auto raw_out = go.Pprof("-raw -symbolize=local", path);
  ASSERT_EQ(raw_out.status, 0) << raw_out.err;
  RawProfile raw = ParseRaw(raw_out.out);
  EXPECT_EQ(raw.HeapValuesWith("alpha_leaks"), kChildSites.at("alpha_leaks"))
      << raw_out.out << raw_out.err;
  EXPECT_EQ(raw.HeapValuesWith("churn"), kChildSites.at("churn")) << raw_out.out;
}

TEST_F(LivePprofTest, MultiProcessSnapshotWithTags) {
  Child first(collector.socket), second(collector.socket);
  const pid_t pids[2] = {first.pid, second.pid};
  LiveSnapshot s(collector.socket, ByName("pprof_child"), true);
  first.Finish();
  second.Finish();
  ASSERT_EQ(s.r.snapshot_count, 2u);
  hd_symbolizer *symbolizer = nullptr;
  ASSERT_EQ(hd_symbolizer_create(nullptr, &symbolizer), 0);
  hd_pprof_options options = {};
  options.symbolizer = symbolizer;
  options.tags = true;
  std::string path = Path("multi.pb.gz");
  WriteResult w = WriteProfile(&s.r, options, path);
  hd_symbolizer_destroy(symbolizer);
  ASSERT_EQ(w.rc, 0) << w.error;
  Profile p;
  ASSERT_TRUE(Load(path, &p));
  ExpectWellFormed(p);
  std::map<std::string, int64_t> bytes_by_pid;
  std::set<std::string> worker_threads;
  for (const Sample &sample : p.samples) {
    auto labels = p.Labels(sample);
    EXPECT_EQ(labels["process_name"], "pprof_child");
    bytes_by_pid[labels["pid"]] += sample.values[1];
    if (labels["thread"].rfind("hd-worker[", 0) == 0) {
      worker_threads.insert(labels["thread"]);
      EXPECT_EQ(labels["bytes"], "200");
    }
  }
  ASSERT_EQ(bytes_by_pid.size(), 2u);
  for (size_t i = 0; i < 2; i++) {
    const hd_snapshot *snap = s.r.snapshots[i];
    EXPECT_EQ(bytes_by_pid[std::to_string(snap->pid)], LiveTotals(snap)[1]);
  }
  EXPECT_EQ(worker_threads.size(), 2u);

  if (go.go.empty()) GTEST_SKIP() << "go not found: install golang-go to check with go tool pprof";
  auto tags = go.Pprof("-tags", path);
  ASSERT_EQ(tags.status, 0) << tags.err;
  for (const std::string &expected :
       {std::string("process_name:"), std::string("pprof_child"), std::string("pid:"),
        std::to_string(pids[0]), std::to_string(pids[1]), std::string("hd-worker["),
        std::string("pprof_child[")}) {
    EXPECT_NE(tags.out.find(expected), std::string::npos) << expected << " in\n" << tags.out;
  }
  auto one = go.Pprof("-raw -tagfocus=pid=" + std::to_string(pids[0]), path);
  ASSERT_EQ(one.status, 0) << one.err;
  EXPECT_EQ(ParseRaw(one.out).HeapValuesWith("worker_leaks"), kChildSites.at("worker_leaks"))
      << one.out;
}

}  // namespace
