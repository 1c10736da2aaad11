// Symbolization against real ELF files: the fixture library (loaded with dlopen, its regions
// recorded the way libheapdump.so records them), stripped and debug-only copies of it made with
// objcopy, broken files, and a real program under LD_PRELOAD whose live snapshot comes from a
// real collector.
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

extern "C" {
#include "heapdump/fidl/channel.h"
#include "heapdump/fidl/snapshot.h"
#include "heapdump/tools/demangle.h"
#include "heapdump/tools/symbolize.h"
#include "heapdump_client.bindings.h"
#include "symbolize_fixture.h"
}
#include "client.h"
#include "process.h"

// Known code of the test program itself, for names as the linker sees them.
extern "C" __attribute__((noinline)) int hd_symbolize_test_c_function(int x) { return x * 3 + 1; }
namespace hdtest {
__attribute__((noinline)) int CxxFunction(int x) { return x * 5 + 2; }
}  // namespace hdtest

namespace {

namespace fs = std::filesystem;

const char kFixtureSource[] = "symbolize_fixture.c";

bool EndsWith(const char *s, const std::string &suffix) {
  if (s == nullptr) return false;
  std::string str(s);
  return str.size() >= suffix.size() &&
         str.compare(str.size() - suffix.size(), suffix.size(), suffix) == 0;
}

const char *Printable(const char *s) { return s ? s : "(null)"; }

std::string Basename(const std::string &path) { return fs::path(path).filename().string(); }

// A fixture library, loaded once for the whole test program: symbolize_fixture.c built with
// DWARF in the library (HD_FIXTURE_LIB), split into a .dwo file (HD_FIXTURE_SPLIT_LIB) or in
// version 4 (HD_FIXTURE_DWARF4_LIB).
struct Fixture {
  void (*noinline)();
  void (*outer)();
  void (*run_ends_in_call)();
  int (*follows)();
  hd_fixture_site *last;
};

const Fixture &LoadedFixture(const std::string &path = HD_FIXTURE_LIB) {
  static std::map<std::string, Fixture> loaded;
  auto found = loaded.find(path);
  if (found == loaded.end()) {
    void *handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      ADD_FAILURE() << dlerror();
      abort();
    }
    Fixture f;
    f.noinline = reinterpret_cast<void (*)()>(dlsym(handle, "hd_fixture_noinline"));
    f.outer = reinterpret_cast<void (*)()>(dlsym(handle, "hd_fixture_outer"));
    f.run_ends_in_call = reinterpret_cast<void (*)()>(dlsym(handle, "hd_fixture_run_ends_in_call"));
    f.follows = reinterpret_cast<int (*)()>(dlsym(handle, "hd_fixture_follows"));
    f.last = static_cast<hd_fixture_site *>(dlsym(handle, "hd_fixture_last"));
    found = loaded.emplace(path, f).first;
  }
  return found->second;
}

// Build ID from the in-memory note, as libheapdump.so reads it.
size_t BuildId(const dl_phdr_info *info, uint8_t *out, size_t capacity) {
  for (int i = 0; i < info->dlpi_phnum; i++) {
    const ElfW(Phdr) &ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_NOTE) continue;
    const uint8_t *p = reinterpret_cast<const uint8_t *>(info->dlpi_addr + ph.p_vaddr);
    const uint8_t *end = p + ph.p_memsz;
    while (p + sizeof(ElfW(Nhdr)) <= end) {
      const ElfW(Nhdr) *n = reinterpret_cast<const ElfW(Nhdr) *>(p);
      const uint8_t *name = p + sizeof(*n);
      const uint8_t *desc = name + ((n->n_namesz + 3u) & ~3u);
      if (desc + ((n->n_descsz + 3u) & ~3u) > end) break;
      if (n->n_type == NT_GNU_BUILD_ID && n->n_namesz == 4 && memcmp(name, "GNU", 4) == 0) {
        size_t size = std::min<size_t>(n->n_descsz, capacity);
        memcpy(out, desc, size);
        return size;
      }
      p = desc + ((n->n_descsz + 3u) & ~3u);
    }
  }
  return 0;
}

// The executable regions of every module loaded in this process, recorded the way
// libheapdump.so records them (instrumentation/src/regions.c), as an hd_snapshot.
class ProcessRegions {
 public:
  ProcessRegions() {
    LoadedFixture(HD_FIXTURE_LIB);
    LoadedFixture(HD_FIXTURE_SPLIT_LIB);
    LoadedFixture(HD_FIXTURE_DWARF4_LIB);
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe_ = std::string(exe, n > 0 ? n : 0);
    dl_iterate_phdr(Visit, this);
    snapshot_.regions = regions_.data();
    snapshot_.region_count = regions_.size();
  }
  const hd_snapshot *snapshot() const { return &snapshot_; }
  hd_snapshot_region &FixtureRegion(const char *path = HD_FIXTURE_LIB) {
    hd_snapshot_region *found = nullptr;
    for (auto &r : regions_) {
      if (strcmp(r.name, path) == 0) {
        EXPECT_EQ(found, nullptr) << "the fixture has one executable segment";
        found = &r;
      }
    }
    EXPECT_NE(found, nullptr);
    return *found;
  }
  void Rename(hd_snapshot_region &r, const std::string &name) {
    names_.push_back(name);
    r.name = names_.back().data();
  }

 private:
  static int Visit(dl_phdr_info *info, size_t, void *arg) {
    auto *self = static_cast<ProcessRegions *>(arg);
    const char *name = info->dlpi_name && info->dlpi_name[0] ? info->dlpi_name : self->exe_.c_str();
    for (int i = 0; i < info->dlpi_phnum; i++) {
      const ElfW(Phdr) &ph = info->dlpi_phdr[i];
      if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_X)) continue;
      hd_snapshot_region r{};
      r.address = info->dlpi_addr + ph.p_vaddr;
      r.size = ph.p_memsz;
      r.file_offset = ph.p_offset;
      r.vaddr = ph.p_vaddr;
      r.build_id_size = BuildId(info, r.build_id, sizeof r.build_id);
      self->names_.push_back(name);
      r.name = self->names_.back().data();
      self->regions_.push_back(r);
    }
    return 0;
  }
  std::string exe_;
  std::deque<std::string> names_;
  std::vector<hd_snapshot_region> regions_;
  hd_snapshot snapshot_{};
};

class Symbolizer {
 public:
  explicit Symbolizer(const std::vector<std::string> &debug_dirs = {}, bool trusted_only = false) {
    std::vector<const char *> dirs;
    for (const auto &d : debug_dirs) dirs.push_back(d.c_str());
    hd_symbolizer_options options = {dirs.data(), dirs.size(), trusted_only};
    EXPECT_EQ(hd_symbolizer_create(&options, &s_), 0);
  }
  ~Symbolizer() { hd_symbolizer_destroy(s_); }
  hd_location_info At(const hd_snapshot *snap, uint64_t address, bool is_return_address) {
    hd_location_info info;
    hd_symbolize(s_, snap, address, is_return_address, &info);
    return info;
  }
  bool found_symbols() const { return hd_symbolizer_found_symbols(s_); }

 private:
  hd_symbolizer *s_ = nullptr;
};

std::string Name(const hd_location_info &loc, uint64_t address) {
  char buffer[512];
  return hd_location_name(&loc, address, buffer, sizeof buffer);
}

std::string Hex(uint64_t value) {
  char buffer[32];
  snprintf(buffer, sizeof buffer, "0x%llx", static_cast<unsigned long long>(value));
  return buffer;
}

uint64_t Address(const void *p) { return reinterpret_cast<uintptr_t>(p); }

// hd_fixture_outer's call into hd_fixture_record, inside the inlined fixture_inlined.
uint64_t InlinedCallSite(const Fixture &fixture = LoadedFixture()) {
  fixture.outer();
  return Address(fixture.last->return_address);
}

// The fixture's frames at its inlined call site, fully resolved.
void ExpectInlinedFrames(const hd_location_info &loc, const Fixture &fixture = LoadedFixture()) {
  const hd_fixture_site &site = *fixture.last;
  ASSERT_EQ(loc.frame_count, 2u);
  EXPECT_STREQ(loc.frames[0].function, "fixture_inlined");
  EXPECT_TRUE(EndsWith(loc.frames[0].file, kFixtureSource)) << Printable(loc.frames[0].file);
  EXPECT_EQ(loc.frames[0].line, static_cast<uint32_t>(site.line));
  EXPECT_STREQ(loc.frames[1].function, "hd_fixture_outer");
  EXPECT_TRUE(EndsWith(loc.frames[1].file, kFixtureSource)) << Printable(loc.frames[1].file);
  EXPECT_EQ(loc.frames[1].line, static_cast<uint32_t>(site.caller_line));
}

// Only the function name, from an ELF symbol table.
void ExpectSymbolOnly(const hd_location_info &loc, const char *function) {
  ASSERT_EQ(loc.frame_count, 1u);
  EXPECT_STREQ(loc.frames[0].function, function);
  EXPECT_EQ(loc.frames[0].file, nullptr);
  EXPECT_EQ(loc.frames[0].line, 0u);
}

// A scratch directory for copies of the fixture, made with objcopy; kept when the test fails.
class Files {
 public:
  std::string Path(const std::string &relative) const {
    std::string path = dir_ + "/" + relative;
    fs::create_directories(fs::path(path).parent_path());
    return path;
  }
  // Runs a command in the scratch directory (so --add-gnu-debuglink finds the file by name).
  void Run(const std::string &command_line) const {
    std::string command = "cd '" + dir_ + "' && " + command_line;
    ASSERT_EQ(system(command.c_str()), 0) << command;
  }
  void Objcopy(const std::string &args) const { Run("objcopy " + args); }
  void Copy(const std::string &from, const std::string &to) const {
    fs::copy_file(from, to, fs::copy_options::overwrite_existing);
  }
  void Write(const std::string &path, const std::string &bytes) const {
    hdtest::WriteFile(path, bytes);
  }
  std::string Read(const std::string &path) const { return hdtest::ReadFile(path); }
  const std::string &dir() const { return dir_; }

 private:
  std::string dir_ = hdtest::TempDir("symbolize");
  hdtest::RemoveWhenPassed remove_{dir_};
};

std::string BuildIdPath(const std::string &root, const hd_snapshot_region &r) {
  std::string path = root + "/.build-id/";
  char hex[3];
  for (size_t i = 0; i < r.build_id_size; i++) {
    snprintf(hex, sizeof hex, "%02x", r.build_id[i]);
    path += hex;
    if (i == 0) path += "/";
  }
  return path + ".debug";
}

size_t OpenDescriptors() {
  size_t count = 0;
  for ([[maybe_unused]] const auto &entry : fs::directory_iterator("/proc/self/fd")) count++;
  return count;
}

class SymbolizeTest : public ::testing::Test {
 protected:
  const Fixture &fixture = LoadedFixture();
  ProcessRegions regions;
  hd_snapshot_region &fixture_region = regions.FixtureRegion();
  Files files;
};

TEST_F(SymbolizeTest, NoinlineFunctionHasFileAndLine) {
  fixture.noinline();
  uint64_t address = Address(fixture.last->return_address);
  Symbolizer symbolizer;
  EXPECT_FALSE(symbolizer.found_symbols());
  hd_location_info loc = symbolizer.At(regions.snapshot(), address, true);
  EXPECT_TRUE(symbolizer.found_symbols());
  EXPECT_EQ(loc.region, &fixture_region);
  EXPECT_EQ(std::string(loc.module), Basename(HD_FIXTURE_LIB));
  EXPECT_EQ(loc.module_offset, address - fixture_region.address + fixture_region.file_offset);
  ASSERT_EQ(loc.frame_count, 1u);
  EXPECT_STREQ(loc.frames[0].function, "hd_fixture_noinline");
  EXPECT_TRUE(EndsWith(loc.frames[0].file, kFixtureSource));
  EXPECT_EQ(loc.frames[0].line, static_cast<uint32_t>(fixture.last->line));
  EXPECT_EQ(Name(loc, address), "hd_fixture_noinline");
}

TEST_F(SymbolizeTest, InlinedFramesCarryTheirCallSites) {
  uint64_t address = InlinedCallSite();
  Symbolizer symbolizer;
  hd_location_info loc = symbolizer.At(regions.snapshot(), address, true);
  ExpectInlinedFrames(loc);
  EXPECT_EQ(Name(loc, address), "hd_fixture_outer");
}

TEST_F(SymbolizeTest, SplitDwarfIsReadThroughTheSkeletonUnit) {
  const Fixture &split = LoadedFixture(HD_FIXTURE_SPLIT_LIB);
  uint64_t address = InlinedCallSite(split);
  Symbolizer symbolizer;
  ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true), split);
}

TEST_F(SymbolizeTest, ModuleFilesAreOpenedOnce) {
  // Resolving more addresses of a module needs no file once it is open.
  std::string copy = files.Path(Basename(HD_FIXTURE_LIB));
  files.Copy(HD_FIXTURE_LIB, copy);
  regions.Rename(fixture_region, copy);
  Symbolizer symbolizer;
  fixture.noinline();
  uint64_t noinline = Address(fixture.last->return_address);
  EXPECT_EQ(Name(symbolizer.At(regions.snapshot(), noinline, true), noinline),
            "hd_fixture_noinline");
  fs::remove(copy);
  ExpectInlinedFrames(symbolizer.At(regions.snapshot(), InlinedCallSite(), true));
}

TEST_F(SymbolizeTest, ReturnAddressIsLookedUpOneByteBefore) {
  fixture.run_ends_in_call();
  // The call is hd_fixture_ends_in_call's last instruction: its return address is past the end.
  uint64_t address = Address(fixture.last->return_address);
  Symbolizer symbolizer;
  EXPECT_EQ(Name(symbolizer.At(regions.snapshot(), address, true), address),
            "hd_fixture_ends_in_call");
  EXPECT_NE(Name(symbolizer.At(regions.snapshot(), address, false), address),
            "hd_fixture_ends_in_call");
  // A leaf address is taken as is: the first byte of a function is that function.
  uint64_t follows = Address(reinterpret_cast<void *>(fixture.follows));
  EXPECT_EQ(Name(symbolizer.At(regions.snapshot(), follows, false), follows), "hd_fixture_follows");
}

// The symbolizer gives linkage names; the display name of a location is demangled.
TEST_F(SymbolizeTest, NamesAreLinkageNamesAndDisplayNamesAreDemangled) {
  Symbolizer symbolizer;
  uint64_t c = Address(reinterpret_cast<void *>(&hd_symbolize_test_c_function));
  uint64_t cxx = Address(reinterpret_cast<void *>(&hdtest::CxxFunction));
  EXPECT_EQ(Name(symbolizer.At(regions.snapshot(), c, false), c), "hd_symbolize_test_c_function");
  hd_location_info loc = symbolizer.At(regions.snapshot(), cxx, false);
  EXPECT_EQ(Name(loc, cxx), "hdtest::CxxFunction(int)");
  ASSERT_GE(loc.frame_count, 1u);
  EXPECT_STREQ(loc.frames[loc.frame_count - 1].function, "_ZN6hdtest11CxxFunctionEi");
  EXPECT_TRUE(EndsWith(loc.frames[loc.frame_count - 1].file, "symbolize_test.cc"));
}

TEST_F(SymbolizeTest, StrippedBinaryFallsBackToDynsym) {
  std::string stripped = files.Path("lib/" + Basename(HD_FIXTURE_LIB));
  files.Objcopy("--strip-all '" HD_FIXTURE_LIB "' '" + stripped + "'");
  regions.Rename(fixture_region, stripped);
  uint64_t address = InlinedCallSite();
  Symbolizer symbolizer;
  ExpectSymbolOnly(symbolizer.At(regions.snapshot(), address, true), "hd_fixture_outer");
  EXPECT_TRUE(symbolizer.found_symbols());
}

// A root collector symbolizes paths an unprivileged process named: with trusted_files_only it
// reads no file that another user could have written (group- or world-writable here).
TEST_F(SymbolizeTest, TrustedFilesOnlyLeavesWritableFilesUnread) {
  std::string copy = files.Path("lib/" + Basename(HD_FIXTURE_LIB));
  files.Objcopy("'" HD_FIXTURE_LIB "' '" + copy + "'");
  regions.Rename(fixture_region, copy);
  uint64_t address = InlinedCallSite();
  ASSERT_EQ(chmod(copy.c_str(), 0664), 0);
  Symbolizer trusting({}, true);
  EXPECT_EQ(trusting.At(regions.snapshot(), address, true).frame_count, 0u);
  EXPECT_FALSE(trusting.found_symbols());
  Symbolizer plain;
  ExpectInlinedFrames(plain.At(regions.snapshot(), address, true));
  ASSERT_EQ(chmod(copy.c_str(), 0644), 0);
  Symbolizer trusting_again({}, true);
  ExpectInlinedFrames(trusting_again.At(regions.snapshot(), address, true));
}

TEST_F(SymbolizeTest, DebugFileInBuildIdLayoutOfADebugDir) {
  std::string stripped = files.Path("lib/" + Basename(HD_FIXTURE_LIB));
  files.Objcopy("--strip-all '" HD_FIXTURE_LIB "' '" + stripped + "'");
  files.Objcopy("--only-keep-debug '" HD_FIXTURE_LIB "' '" +
                files.Path(BuildIdPath("debug", fixture_region)) + "'");
  regions.Rename(fixture_region, stripped);
  uint64_t address = InlinedCallSite();
  Symbolizer symbolizer({files.dir() + "/debug"});
  ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true));
}

TEST_F(SymbolizeTest, DebugFileByBasenameInADebugDirWithoutTheBinary) {
  files.Objcopy("--only-keep-debug '" HD_FIXTURE_LIB "' '" +
                files.Path("debug/" + Basename(HD_FIXTURE_LIB)) + "'");
  regions.Rename(fixture_region, files.dir() + "/gone/" + Basename(HD_FIXTURE_LIB));
  uint64_t address = InlinedCallSite();
  Symbolizer symbolizer({files.dir() + "/nothing-here", files.dir() + "/debug"});
  ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true));
}

TEST_F(SymbolizeTest, CompressedDebugSections) {
  regions.Rename(fixture_region, files.dir() + "/gone.so");
  uint64_t address = InlinedCallSite();
  // SHF_COMPRESSED sections, and the older .zdebug_* ones.
  for (const char *style : {"zlib-gabi", "zlib-gnu"}) {
    std::string debug_dir = files.dir() + "/" + style;
    files.Objcopy(std::string("--only-keep-debug --compress-debug-sections=") + style + " '" +
                  HD_FIXTURE_LIB "' '" + files.Path(BuildIdPath(style, fixture_region)) + "'");
    Symbolizer symbolizer({debug_dir});
    ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true));
  }
}

TEST_F(SymbolizeTest, DwarfVersion4) {
  const Fixture &dwarf4 = LoadedFixture(HD_FIXTURE_DWARF4_LIB);
  uint64_t address = InlinedCallSite(dwarf4);
  Symbolizer symbolizer;
  ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true), dwarf4);
}

TEST_F(SymbolizeTest, DwzSupplementaryFile) {
  // dwz moves what debug files have in common into a supplementary file they link to, as
  // Debian's -dbgsym packages do (there under /usr/lib/debug/.dwz/). The DWARF 4 build: dwz 0.15
  // cannot read clang's DWARF 5.
  const Fixture &dwarf4 = LoadedFixture(HD_FIXTURE_DWARF4_LIB);
  hd_snapshot_region &region = regions.FixtureRegion(HD_FIXTURE_DWARF4_LIB);
  std::string common = files.Path("debug/.dwz/common.debug");
  files.Objcopy("--only-keep-debug '" HD_FIXTURE_DWARF4_LIB "' a.debug");
  files.Copy(files.dir() + "/a.debug", files.dir() + "/b.debug");
  files.Run("dwz -m '" + common + "' -M '" + common + "' a.debug b.debug");
  fs::rename(files.dir() + "/a.debug", files.Path(BuildIdPath("debug", region)));
  regions.Rename(region, files.dir() + "/gone.so");
  uint64_t address = InlinedCallSite(dwarf4);
  {
    Symbolizer symbolizer({files.dir() + "/debug"});
    ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true), dwarf4);
  }
  // The name of the inlined function is in the supplementary file.
  fs::remove(common);
  Symbolizer symbolizer({files.dir() + "/debug"});
  hd_location_info loc = symbolizer.At(regions.snapshot(), address, true);
  ASSERT_EQ(loc.frame_count, 2u);
  EXPECT_EQ(loc.frames[0].function, nullptr);
}

TEST_F(SymbolizeTest, DebuglinkNextToTheBinaryInDotDebugAndInADebugDir) {
  files.Objcopy("--only-keep-debug '" HD_FIXTURE_LIB "' fixture.debug");
  files.Objcopy("--strip-all --add-gnu-debuglink=fixture.debug '" HD_FIXTURE_LIB "' " +
                files.Path("linked.so"));
  regions.Rename(fixture_region, files.dir() + "/linked.so");
  uint64_t address = InlinedCallSite();
  {
    Symbolizer symbolizer;
    ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true));
  }
  fs::rename(files.dir() + "/fixture.debug", files.Path(".debug/fixture.debug"));
  {
    Symbolizer symbolizer;
    ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true));
  }
  fs::rename(files.dir() + "/.debug/fixture.debug", files.Path("elsewhere/fixture.debug"));
  {
    Symbolizer symbolizer({files.dir() + "/elsewhere"});
    ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true));
  }
  {
    Symbolizer symbolizer;
    ExpectSymbolOnly(symbolizer.At(regions.snapshot(), address, true), "hd_fixture_outer");
  }
}

TEST_F(SymbolizeTest, FileWithAnotherBuildIdIsNotUsed) {
  // The program was rebuilt since the snapshot: another ELF file is at the region's path.
  std::string rebuilt = files.Path(Basename(HD_FIXTURE_LIB));
  files.Copy(HD_SYMBOLIZE_CHILD, rebuilt);
  regions.Rename(fixture_region, rebuilt);
  // And a debug directory holds another file's debug information under this build ID.
  files.Objcopy("--only-keep-debug '" HD_SYMBOLIZE_CHILD "' '" +
                files.Path(BuildIdPath("debug", fixture_region)) + "'");
  uint64_t address = InlinedCallSite();
  Symbolizer symbolizer({files.dir() + "/debug"});
  hd_location_info loc = symbolizer.At(regions.snapshot(), address, true);
  EXPECT_EQ(loc.frame_count, 0u);
  EXPECT_FALSE(symbolizer.found_symbols());
  EXPECT_EQ(Name(loc, address),
            Basename(HD_FIXTURE_LIB) + "+" +
                Hex(address - fixture_region.address + fixture_region.file_offset));
}

TEST_F(SymbolizeTest, BuildIdMismatchWithTheFileAtThePath) {
  fixture_region.build_id[0] ^= 0xff;
  uint64_t address = InlinedCallSite();
  Symbolizer symbolizer;
  EXPECT_EQ(symbolizer.At(regions.snapshot(), address, true).frame_count, 0u);
  EXPECT_FALSE(symbolizer.found_symbols());
}

TEST_F(SymbolizeTest, RegionWithoutBuildIdUsesTheFileAtItsPathOnlyIfItHasNoneEither) {
  fixture_region.build_id_size = 0;
  uint64_t address = InlinedCallSite();
  {
    Symbolizer symbolizer;  // the fixture has a build ID: a different build
    EXPECT_EQ(symbolizer.At(regions.snapshot(), address, true).frame_count, 0u);
  }
  files.Objcopy("--remove-section=.note.gnu.build-id '" HD_FIXTURE_LIB "' no-id.so");
  regions.Rename(fixture_region, files.dir() + "/no-id.so");
  Symbolizer symbolizer;
  ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true));
}

TEST_F(SymbolizeTest, DebuglinkWithoutBuildIdIsCheckedByCrc) {
  fixture_region.build_id_size = 0;
  files.Objcopy("--remove-section=.note.gnu.build-id '" HD_FIXTURE_LIB "' no-id.so");
  files.Objcopy("--only-keep-debug no-id.so no-id.debug");
  files.Objcopy("--strip-all --add-gnu-debuglink=no-id.debug no-id.so no-id-stripped.so");
  regions.Rename(fixture_region, files.dir() + "/no-id-stripped.so");
  uint64_t address = InlinedCallSite();
  {
    Symbolizer symbolizer;
    ExpectInlinedFrames(symbolizer.At(regions.snapshot(), address, true));
  }
  // Still an ELF file, but no longer the one the link was made for.
  std::ofstream(files.dir() + "/no-id.debug", std::ios::binary | std::ios::app) << '\0';
  Symbolizer symbolizer;
  ExpectSymbolOnly(symbolizer.At(regions.snapshot(), address, true), "hd_fixture_outer");
}

TEST_F(SymbolizeTest, MissingFileGivesModuleAndOffset) {
  regions.Rename(fixture_region, "/nonexistent/dir/libgone.so");
  uint64_t address = InlinedCallSite();
  Symbolizer symbolizer;
  hd_location_info loc = symbolizer.At(regions.snapshot(), address, true);
  EXPECT_EQ(loc.frame_count, 0u);
  EXPECT_EQ(loc.region, &fixture_region);
  EXPECT_EQ(Name(loc, address),
            "libgone.so+" + Hex(address - fixture_region.address + fixture_region.file_offset));
  EXPECT_FALSE(symbolizer.found_symbols());
}

TEST_F(SymbolizeTest, AddressInNoRegion) {
  Symbolizer symbolizer;
  hd_location_info loc = symbolizer.At(regions.snapshot(), 0x10, false);
  EXPECT_EQ(loc.region, nullptr);
  EXPECT_STREQ(loc.module, "");
  EXPECT_EQ(loc.frame_count, 0u);
  EXPECT_EQ(Name(loc, 0x10), "0x10");
}

TEST_F(SymbolizeTest, BrokenFilesAreUnresolvedWithoutCrashing) {
  std::string image = files.Read(HD_FIXTURE_LIB);
  ASSERT_GT(image.size(), 4096u);
  std::string garbage;
  uint32_t state = 12345;
  for (size_t i = 0; i < image.size(); i++) {
    state = state * 1103515245u + 12345u;
    garbage += static_cast<char>(state >> 24);
  }
  // Section headers pointing far past the end of the file.
  std::string bad_sections = image;
  memset(&bad_sections[offsetof(ElfW(Ehdr), e_shoff)], 0x7f, sizeof(ElfW(Off)));
  std::vector<std::pair<std::string, std::string>> broken = {
      {"empty", ""},
      {"text", "not an ELF file\n"},
      {"header-only", image.substr(0, sizeof(ElfW(Ehdr)))},
      {"half", image.substr(0, image.size() / 2)},
      {"garbage", garbage},
      {"bad-section-headers", bad_sections},
  };
  for (auto &[name, bytes] : broken) files.Write(files.Path(name), bytes);
  fs::create_directories(files.dir() + "/directory");
  ASSERT_EQ(mkfifo((files.dir() + "/fifo").c_str(), 0600), 0);
  broken.push_back({"directory", ""});
  broken.push_back({"fifo", ""});
  fixture_region.build_id_size = 0;  // nothing rules the files out before they are read
  uint64_t address = InlinedCallSite();
  for (const auto &[name, bytes] : broken) {
    regions.Rename(fixture_region, files.dir() + "/" + name);
    Symbolizer symbolizer({files.dir()});  // each is also its own debug-file candidate
    hd_location_info loc = symbolizer.At(regions.snapshot(), address, true);
    EXPECT_EQ(loc.frame_count, 0u) << name;
    EXPECT_EQ(Name(loc, address), name + "+" + Hex(loc.module_offset)) << name;
  }
}

TEST_F(SymbolizeTest, CorruptDebugInfoFallsBackToTheSymbolTable) {
  std::string garbage(4096, '\0');
  uint32_t state = 777;
  for (char &c : garbage) {
    state = state * 1103515245u + 12345u;
    c = static_cast<char>(state >> 24);
  }
  files.Write(files.Path("garbage.bin"), garbage);
  files.Objcopy("--update-section .debug_info=garbage.bin '" HD_FIXTURE_LIB "' corrupt.so");
  regions.Rename(fixture_region, files.dir() + "/corrupt.so");
  uint64_t address = InlinedCallSite();
  Symbolizer symbolizer;
  hd_location_info loc = symbolizer.At(regions.snapshot(), address, true);
  EXPECT_EQ(Name(loc, address), "hd_fixture_outer");
}

TEST_F(SymbolizeTest, ModulesAndAddressesAreCached) {
  Symbolizer symbolizer;
  const hd_snapshot *snap = regions.snapshot();
  // Thousands of addresses over every module of this process, each looked up twice: the second
  // time gives the very same frames and opens nothing.
  struct Seen {
    uint64_t address;
    bool is_return_address;
    hd_location_info info;
  };
  std::vector<Seen> seen;
  size_t resolved = 0;
  for (size_t r = 0; r < snap->region_count; r++) {
    const hd_snapshot_region &region = snap->regions[r];
    for (uint64_t offset = 0; offset < region.size; offset += region.size / 1000 + 1) {
      Seen s = {region.address + offset, offset % 2 == 1, {}};
      s.info = symbolizer.At(snap, s.address, s.is_return_address);
      EXPECT_EQ(s.info.region, &region);
      resolved += s.info.frame_count > 0;
      seen.push_back(s);
    }
  }
  ASSERT_GT(seen.size(), 2000u);
  EXPECT_GT(resolved, seen.size() / 2);
  size_t descriptors = OpenDescriptors();
  for (const Seen &s : seen) {
    hd_location_info again = symbolizer.At(snap, s.address, s.is_return_address);
    EXPECT_EQ(again.frames, s.info.frames);
    EXPECT_EQ(again.frame_count, s.info.frame_count);
  }
  EXPECT_EQ(OpenDescriptors(), descriptors);
}

TEST(SymbolizeApiTest, LocationNameIsTruncatedToTheBuffer) {
  hd_source_frame frame = {"a_rather_long_function_name", nullptr, 0, 0};
  hd_location_info loc = {};
  loc.module = "";
  loc.frames = &frame;
  loc.frame_count = 1;
  char buffer[8];
  EXPECT_STREQ(hd_location_name(&loc, 0, buffer, sizeof buffer), "a_rathe");
  EXPECT_EQ(hd_location_name(&loc, 0, buffer, 0), buffer);
}

TEST(SymbolizeApiTest, CreateRejectsANullDebugDir) {
  const char *dirs[] = {"/tmp", nullptr};
  hd_symbolizer_options options = {dirs, 2, false};
  hd_symbolizer *s = reinterpret_cast<hd_symbolizer *>(1);
  EXPECT_EQ(hd_symbolizer_create(&options, &s), -EINVAL);
  EXPECT_EQ(s, nullptr);
  ASSERT_EQ(hd_symbolizer_create(nullptr, &s), 0);
  hd_symbolizer_destroy(s);
}

// ---- End to end: a real program under LD_PRELOAD and a real collector -----------------------

TEST(SymbolizeEndToEndTest, SnapshotStacksResolveToTheAllocatingCode) {
  Files files;
  hdtest::Collector collector(files.dir());
  collector.Start();
  if (HasFatalFailure()) return;
  hdtest::Program child({HD_SYMBOLIZE_CHILD}, hdtest::InstrumentedEnv(collector.socket));
  int pid = 0, malloc_line = 0, call_line = 0;
  const std::string ready = child.ReadLine();
  ASSERT_EQ(sscanf(ready.c_str(), "ready %d %d %d", &pid, &malloc_line, &call_line), 3) << ready;
  EXPECT_EQ(pid, child.pid);

  const heapdump_client_ProcessSelector selector = hdtest::ByPid(child.pid);
  std::unique_ptr<hdtest::Result> result = hdtest::TakeLiveSnapshot(collector.socket, &selector);
  ASSERT_EQ(result->status, HD_OK) << result->ra.error;
  ASSERT_EQ(result->error, 0u);
  const hd_snapshot *snap = result->only();
  ASSERT_NE(snap, nullptr);

  // The instrumentation drops its own frames: every address of a trace, the first included, is
  // a return address into the code that made the call.
  Symbolizer symbolizer;
  size_t blocks = 0;
  for (size_t i = 0; i < snap->allocation_count; i++) {
    const hd_snapshot_allocation &a = snap->allocations[i];
    if (a.size != 4242) continue;
    blocks++;
    const hd_snapshot_stack_trace *trace = hd_snapshot_find_stack_trace(snap, a.stack_trace_key);
    ASSERT_NE(trace, nullptr);
    ASSERT_GE(trace->count, 2u);
    std::vector<std::string> names;
    for (size_t f = 0; f < trace->count; f++) {
      names.push_back(Name(symbolizer.At(snap, trace->addresses[f], true), trace->addresses[f]));
    }
    hd_location_info loc = symbolizer.At(snap, trace->addresses[0], true);
    ASSERT_EQ(loc.frame_count, 2u) << testing::PrintToString(names);
    EXPECT_STREQ(loc.frames[0].function, "child_inlined_alloc");
    EXPECT_TRUE(EndsWith(loc.frames[0].file, "symbolize_child.c"));
    EXPECT_EQ(loc.frames[0].line, static_cast<uint32_t>(malloc_line));
    EXPECT_STREQ(loc.frames[1].function, "child_allocates");
    EXPECT_EQ(loc.frames[1].line, static_cast<uint32_t>(call_line));
    EXPECT_EQ(names[0], "child_allocates");
    EXPECT_EQ(names[1], "main");
  }
  EXPECT_EQ(blocks, 3u);
  EXPECT_TRUE(symbolizer.found_symbols());

  child.Send("go");
  const int status = child.Finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

// C++ and Rust (legacy and v0) names read as c++filt prints them; anything else is its own
// name; each name is demangled once.
TEST(Demangle, CxxAndRustNamesReadAsInTheSource) {
  EXPECT_STREQ(hd_demangle("_ZN4shop11make_basketEi"), "shop::make_basket(int)");
  EXPECT_STREQ(hd_demangle("_ZNSt6vectorIiSaIiEE9push_backERKi"),
               "std::vector<int, std::allocator<int> >::push_back(int const&)");
  EXPECT_STREQ(hd_demangle("_RNvCs1234_7mycrate3foo"), "mycrate::foo");
  EXPECT_STREQ(hd_demangle("_ZN7mycrate3foo17h0123456789abcdefE"), "mycrate::foo");
  const char *c_name = "main", *not_mangled = "_Zgarbage";
  EXPECT_EQ(hd_demangle(c_name), c_name);
  EXPECT_EQ(hd_demangle(not_mangled), not_mangled);
  EXPECT_EQ(hd_demangle(nullptr), nullptr);
  const std::string copy = "_ZN4shop11make_basketEi";
  EXPECT_EQ(hd_demangle(copy.c_str()), hd_demangle("_ZN4shop11make_basketEi"));
}

TEST(Demangle, TheStandardLibraryIsKnownByItsMangledNames) {
  for (const char *name : {"_ZNSt6vectorIiSaIiEE17_M_realloc_insertIJRKiEEEvN9__gnu_cxx17__normal_"
                           "iteratorIPiS1_EEDpOT_",
                           "_ZNKSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE4sizeEv",
                           "_ZNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEE12_M_"
                           "constructIPKcEEvT_S8_St20forward_iterator_tag",
                           "_ZSt4sortIPiEvT_S1_", "_ZN9__gnu_cxx13new_allocatorIiE8allocateEmPKv",
                           "_ZNSs4_Rep9_S_createEmmRKSaIcE"}) {
    EXPECT_TRUE(hd_is_std_library_name(name)) << name;
  }
  for (const char *name : {"_ZN4shop11make_basketEi", "_Z3fooSt6vectorIiSaIiEE", "main",
                           "_ZN5state3getEv", "_RNvCs1234_7mycrate3foo"}) {
    EXPECT_FALSE(hd_is_std_library_name(name)) << name;
  }
  EXPECT_FALSE(hd_is_std_library_name(nullptr));
}

}  // namespace
