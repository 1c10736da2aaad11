// Stacks that are hard to unwind, and hard to reuse a trace for, allocated through under
// LD_PRELOAD=libheapdump.so with HEAPDUMP_UNWIND=compare (Unwinders in preload_test.cc). Built
// -O2 -fomit-frame-pointer, as most distributions build their packages: rbp is an ordinary
// register here. Each mode allocates and exits normally, so the library prints its comparison.
//
//   unwind_child callers        one call site reached from different callers at the same depth
//   unwind_child branches       deep recursion along paths that change a level at a time
//   unwind_child carried_rbp    inner frames alike but for the rbp their rbp-based caller uses
//   unwind_child exceptions     destructors that allocate while an exception unwinds through them
//   unwind_child longjmp        longjmp out of deep allocating recursion, again and again
//   unwind_child coroutines     makecontext/swapcontext stacks of the program's own
//   unwind_child dlclose LIB    a module loaded, allocated through, closed and loaded again
//   unwind_child iconv          modules glibc loads and unloads itself (gconv), without dlopen
//   unwind_child realigned      frames that realign the stack for over-aligned locals
//   unwind_child plt            signals that interrupt a PLT entry, with a handler that allocates
//   unwind_child loader         walks after every cached rule was dropped, counting the loader's
//                               dl_iterate_phdr calls (libhd_loader_counter.so preloaded first)
#include <alloca.h>
#include <dlfcn.h>
#include <elf.h>
#include <iconv.h>
#include <link.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <ucontext.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace {

#define CHECK(x)                                                            \
  do {                                                                      \
    if (!(x)) {                                                             \
      fprintf(stderr, "unwind_child: %s:%d: %s\n", __FILE__, __LINE__, #x); \
      exit(2);                                                              \
    }                                                                       \
  } while (0)

// Keeps a pointer alive in the compiler's eyes, so no allocation is optimised away.
void *volatile g_sink;
void keep(void *p) { g_sink = p; }

// The one call site, always reached through `middle`: the innermost frames of every trace are
// the same, at the same stack depth and stack pointer; only the frame above `middle` tells the
// callers apart. A reused trace that checked too little would show the wrong caller.
__attribute__((noinline)) void *site(size_t n, long salt) {
  void *p = malloc(n);
  __asm__ volatile("" : : "r"(p), "r"(salt) : "memory");
  return p;
}

__attribute__((noinline)) void *middle(size_t n, long salt) {
  void *p = site(n, salt);
  __asm__ volatile("" : : "r"(p) : "memory");  // not a tail call
  return p;
}

__attribute__((noinline)) void via_a(long i) {
  void *p = middle(100, i * 3);
  keep(p);
  free(p);
}

__attribute__((noinline)) void via_b(long i) {
  void *p = middle(100, i ^ 0x5a5a);
  keep(p);
  free(p);
}

__attribute__((noinline)) void via_c(long i) {
  long local[4] = {i, i + 1, i + 2, i + 3};  // other data where rbp and locals are saved
  void *p = middle(100, local[(i + 1) % 4]);
  keep(p);
  free(p);
}

void mode_callers() {
  for (long i = 0; i < 300000; i++) {
    switch (i % 3) {
      case 0: via_a(i); break;
      case 1: via_b(i); break;
      default: via_c(i); break;
    }
  }
}

// Deep recursion through one of two functions at every level, along a path that changes one
// level per allocation: each walk shares its outer frames with the walk before, and below the
// level that changed its frames stand where the previous walk's did (the two functions have the
// same frame), with the same program counters, while a return address above them differs. A
// walk that joined the previous one too early would show the previous path. Three depths: a
// memo holds the shallow walks, not the deeper ones, and the deepest are cut by the capacity.
__attribute__((noinline)) void *descend(int depth, unsigned long path);

__attribute__((noinline)) void *left(int depth, unsigned long path) {
  void *p = descend(depth - 1, path >> 1);
  __asm__ volatile("# left" : : "r"(p) : "memory");  // not a tail call; not folded with right
  return p;
}

__attribute__((noinline)) void *right(int depth, unsigned long path) {
  void *p = descend(depth - 1, path >> 1);
  __asm__ volatile("# right" : : "r"(p) : "memory");
  return p;
}

__attribute__((noinline)) void *descend(int depth, unsigned long path) {
  void *p = depth == 0 ? site(64, (long)path) : (path & 1) ? right(depth, path) : left(depth, path);
  __asm__ volatile("" : : "r"(p) : "memory");
  return p;
}

void mode_branches() {
  static const int kDepths[] = {8, 18, 40};  // about 20, 40 and 80 frames
  unsigned long path = 0, state = 12345;
  for (long i = 0; i < 150000; i++) {
    const int depth = kDepths[(i / 1000) % 3];
    state = state * 6364136223846793005u + 1442695040888963407u;
    path ^= 1ul << ((state >> 33) % (unsigned long)depth);
    void *p = descend(depth, path);
    keep(p);
    free(p);
  }
}

// A frame whose CFA is rbp-based (it has a variable-length area) below two callers, under deep
// recursion (no memo holds the walks). The callers alternate, and their own areas put that frame
// 256 bytes apart while its area, 256 bytes longer in the higher one, puts the frames it calls at
// the same place: those frames, which leave rbp alone, stand where the previous walk's did, with
// the same program counters, and the slots the previous walk read above them now lie inside the
// area, unwritten, still holding what they held. Only the rbp they carry, the frame's own,
// tells the walks apart: a walk that joined the previous one without comparing it would show
// the other caller.
__attribute__((noinline)) void *rbp_leaf(void *area) {
  void *p = site(48, (long)area);
  __asm__ volatile("" : : "r"(p) : "memory");
  return p;
}

__attribute__((noinline)) void *rbp_based(size_t area_size) {
  char *area = static_cast<char *>(alloca(area_size));  // left unwritten
  void *p = rbp_leaf(area);
  __asm__ volatile("" : : "r"(p), "r"(area) : "memory");
  return p;
}

// Its own area of kPad bytes, then the frame with an area of kArea: <512, 256> and <256, 512>.
template <size_t kPad, size_t kArea>
__attribute__((noinline)) void *rbp_caller() {
  char *pad = static_cast<char *>(alloca(kPad));
  __asm__ volatile("" : : "r"(pad) : "memory");
  void *p = rbp_based(kArea);
  __asm__ volatile("" : : "r"(p), "r"(pad) : "memory");
  return p;
}

__attribute__((noinline)) void *rbp_nest(int depth, void *(*caller)()) {
  void *p = depth == 0 ? caller() : rbp_nest(depth - 1, caller);
  __asm__ volatile("" : : "r"(p) : "memory");
  return p;
}

void mode_carried_rbp() {
  for (long i = 0; i < 100000; i++) {
    void *p = rbp_nest(45, (i & 1) ? rbp_caller<256, 512> : rbp_caller<512, 256>);
    keep(p);
    free(p);
  }
}

// Allocates while an exception passes through it: the unwinder of the C++ runtime is itself on
// the stack, and the exception object is allocated with malloc too.
struct AllocatingGuard {
  ~AllocatingGuard() {
    std::string s(64 + depth, 'x');
    keep(&s[0]);
    free(malloc(77 + depth));
  }
  int depth;
};

__attribute__((noinline)) void throw_through(int depth) {
  AllocatingGuard guard{depth};
  std::vector<int> v(16 + depth);
  keep(v.data());
  if (depth == 0) throw std::runtime_error(std::string(48, 'e'));
  throw_through(depth - 1);
  keep(v.data());
}

void mode_exceptions() {
  int caught = 0;
  for (int i = 0; i < 3000; i++) {
    try {
      throw_through(i % 12);
    } catch (const std::runtime_error &) {
      caught++;
    }
  }
  CHECK(caught == 3000);
}

jmp_buf g_escape;

__attribute__((noinline, noipa)) void escape() { longjmp(g_escape, 1); }

__attribute__((noinline)) void descend(int depth) {
  void *p = malloc(32 + depth);
  keep(p);
  free(p);
  if (depth == 0) {
    escape();
  } else {
    descend(depth - 1);
  }
  __asm__ volatile("" : : : "memory");  // not a tail call: each level keeps its frame
}

void mode_longjmp() {
  for (volatile int i = 0; i < 20000; i++) {
    if (setjmp(g_escape) == 0) descend(i % 20);
    void *p = site(64, i);  // then the same site again, from a stack the longjmp cut short
    keep(p);
    free(p);
  }
}

ucontext_t g_main_context, g_coroutine_context;

__attribute__((noinline)) void coroutine_allocates(int round) {
  void *p = site(48, round);
  keep(p);
  free(p);
}

void coroutine_body() {
  for (int round = 0;; round++) {
    coroutine_allocates(round);
    CHECK(swapcontext(&g_coroutine_context, &g_main_context) == 0);
  }
}

void mode_coroutines() {
  const size_t stack_size = 256 * 1024;
  void *stack = malloc(stack_size);
  CHECK(stack != nullptr);
  CHECK(getcontext(&g_coroutine_context) == 0);
  g_coroutine_context.uc_stack.ss_sp = stack;
  g_coroutine_context.uc_stack.ss_size = stack_size;
  g_coroutine_context.uc_link = &g_main_context;
  makecontext(&g_coroutine_context, coroutine_body, 0);
  for (int i = 0; i < 2000; i++) {
    CHECK(swapcontext(&g_main_context, &g_coroutine_context) == 0);
    void *p = site(40, i);
    keep(p);
    free(p);
  }
  free(stack);
}

void mode_dlclose(const char *lib) {
  for (int round = 0; round < 50; round++) {
    void *h = dlopen(lib, RTLD_NOW);
    CHECK(h != nullptr);
    auto allocate = reinterpret_cast<void *(*)(size_t)>(dlsym(h, "testlib_allocate_framed"));
    CHECK(allocate != nullptr);
    for (int i = 0; i < 200; i++) free(allocate(100 + i));
    CHECK(dlclose(h) == 0);
    // A module loaded between two rounds can take the closed one's addresses.
    void *other = dlopen("libm.so.6", RTLD_NOW);
    free(site(90, round));
    if (other != nullptr) dlclose(other);
  }
}

// glibc loads a converter module for iconv_open and may unload it at iconv_close, through its
// own loader calls, which the library's dlopen and dlclose hooks never see.
void mode_iconv() {
  static const char *const kCharsets[] = {"EBCDIC-US", "IBM1047",   "ISO-8859-2",
                                          "KOI8-R",    "EBCDIC-FR", "CP1251"};
  int converted = 0;
  for (int round = 0; round < 300; round++) {
    const char *charset = kCharsets[round % (sizeof kCharsets / sizeof kCharsets[0])];
    iconv_t cd = iconv_open(charset, "UTF-8");
    if (cd == (iconv_t)-1) continue;
    char in[] = "heapdump", out[64];
    char *inp = in, *outp = out;
    size_t in_left = strlen(in), out_left = sizeof out;
    if (iconv(cd, &inp, &in_left, &outp, &out_left) != (size_t)-1) converted++;
    free(site(80, round));
    CHECK(iconv_close(cd) == 0);
  }
  CHECK(converted > 0);
}

// Over-aligned locals make GCC realign the stack: rsp is rounded down after rbp is saved, so
// the CFA is rbp-based from there on and the frame's size differs from call to call.
__attribute__((noinline)) void *realigned(size_t n, int depth) {
  alignas(64) char buf[96];
  buf[depth % 96] = static_cast<char>(depth);
  void *p = depth > 0 ? realigned(n, depth - 1) : malloc(n + (buf[depth % 96] & 1));
  __asm__ volatile("" : : "r"(buf), "r"(p) : "memory");  // not a tail call; buf is used
  return p;
}

void mode_realigned() {
  for (long i = 0; i < 20000; i++) {
    void *p = realigned(64 + i % 64, static_cast<int>(i % 6));
    keep(p);
    free(p);
  }
}

// Signals that interrupt a lazy-binding PLT entry (strlen's, called in a loop): the handler
// allocates, so its trace goes through the signal frame into the entry, whose CFA only the
// linker's CFA expression for such entries describes. The program's .plt is found from its
// section headers. Each call is single-stepped (the trap flag, set just before it), so that
// every call's entry is interrupted: a timer's signals landed in the entries in 7% of cases
// with one build's library and under 0.5% with the other's, on one machine (none of 60,000 in a
// CI run).
uintptr_t g_plt_lo, g_plt_hi;
volatile sig_atomic_t g_signals, g_in_plt, g_steps;
const char *volatile g_text = "heapdump";
volatile size_t g_length_sink;
const greg_t kTrapFlag = 0x100;
const int kMaxStepsToTheEntry = 1000;  // a few instructions lie between the flag and the entry

int note_program_base(struct dl_phdr_info *info, size_t, void *base) {
  *static_cast<uintptr_t *>(base) = info->dlpi_addr;
  return 1;  // the program is listed first
}

void find_plt() {
  FILE *f = fopen("/proc/self/exe", "rb");
  CHECK(f != nullptr);
  Elf64_Ehdr eh;
  CHECK(fread(&eh, sizeof eh, 1, f) == 1);
  std::vector<Elf64_Shdr> sections(eh.e_shnum);
  CHECK(eh.e_shstrndx < eh.e_shnum);
  CHECK(fseek(f, static_cast<long>(eh.e_shoff), SEEK_SET) == 0);
  CHECK(fread(sections.data(), sizeof(Elf64_Shdr), sections.size(), f) == sections.size());
  const Elf64_Shdr &names = sections[eh.e_shstrndx];
  std::vector<char> strtab(names.sh_size + 1, '\0');
  CHECK(fseek(f, static_cast<long>(names.sh_offset), SEEK_SET) == 0);
  CHECK(fread(strtab.data(), 1, names.sh_size, f) == names.sh_size);
  fclose(f);
  uintptr_t base = 0;
  dl_iterate_phdr(note_program_base, &base);
  for (const Elf64_Shdr &s : sections) {
    if (s.sh_name < names.sh_size && strcmp(&strtab[s.sh_name], ".plt") == 0) {
      g_plt_lo = base + s.sh_addr;
      g_plt_hi = g_plt_lo + s.sh_size;
    }
  }
  CHECK(g_plt_hi > g_plt_lo);
}

// A step's trap (SIGTRAP), at every instruction from the flag's setting to strlen's entry; the
// first in the entry clears the flag.
void on_step(int, siginfo_t *, void *context) {
  auto *uc = static_cast<ucontext_t *>(context);
  const auto pc = static_cast<uintptr_t>(uc->uc_mcontext.gregs[REG_RIP]);
  g_signals = g_signals + 1;
  g_steps = g_steps + 1;
  const bool in_plt = pc >= g_plt_lo && pc < g_plt_hi;
  if (in_plt) g_in_plt = g_in_plt + 1;
  if (in_plt || g_steps >= kMaxStepsToTheEntry) uc->uc_mcontext.gregs[REG_EFL] &= ~kTrapFlag;
  void *p = malloc(48);
  keep(p);
  free(p);
}

void mode_plt() {
  find_plt();
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_step;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  CHECK(sigaction(SIGTRAP, &sa, nullptr) == 0);
  const int calls = 100;
  size_t total = 0;
  for (int i = 0; i < calls; i++) {
    g_steps = 0;
    // Below the red zone, where the compiler may keep values; the first trap comes after the
    // instruction that follows popfq, once rsp is back.
    asm volatile("sub $128, %%rsp\n\tpushfq\n\torq $0x100, (%%rsp)\n\tpopfq\n\tadd $128, %%rsp" ::
                     : "memory", "cc");
    total += strlen(g_text);
  }
  g_length_sink = total;
  printf("signals %d, in PLT entries %d\n", static_cast<int>(g_signals),
         static_cast<int>(g_in_plt));
  CHECK(g_in_plt == calls);
}

// Every cached rule is dropped when modules change (a dlopen and a dlclose here), so the walks
// after it miss the cache in every frame; all of those frames are in modules loaded with the
// program, which the loader never unloads, so none of the misses needs to ask the loader
// whether modules moved. Prints the dl_iterate_phdr calls made while allocating.
void mode_loader() {
  auto loader_calls =
      reinterpret_cast<unsigned long (*)()>(dlsym(RTLD_DEFAULT, "hd_test_loader_calls"));
  CHECK(loader_calls != nullptr);
  unsigned long while_allocating = 0;
  for (int round = 0; round < 20; round++) {
    void *h = dlopen("libm.so.6", RTLD_NOW);
    CHECK(h != nullptr);
    CHECK(dlclose(h) == 0);
    const unsigned long before = loader_calls();
    for (long i = 0; i < 100; i++) {
      via_a(i);
      via_b(i);
      via_c(i);
      std::string s(200 + i, 'x');  // libstdc++'s frames too
      keep(&s);
    }
    while_allocating += loader_calls() - before;
  }
  printf("loader calls while allocating: %lu\n", while_allocating);
}

}  // namespace

int main(int argc, char **argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "callers")
    mode_callers();
  else if (mode == "branches")
    mode_branches();
  else if (mode == "carried_rbp")
    mode_carried_rbp();
  else if (mode == "exceptions")
    mode_exceptions();
  else if (mode == "longjmp")
    mode_longjmp();
  else if (mode == "coroutines")
    mode_coroutines();
  else if (mode == "dlclose" && argc > 2)
    mode_dlclose(argv[2]);
  else if (mode == "iconv")
    mode_iconv();
  else if (mode == "realigned")
    mode_realigned();
  else if (mode == "plt")
    mode_plt();
  else if (mode == "loader")
    mode_loader();
  else {
    fprintf(stderr,
            "usage: unwind_child "
            "callers|branches|carried_rbp|exceptions|longjmp|coroutines|iconv|realigned|plt|loader"
            "|dlclose LIB\n");
    return 2;
  }
  puts("done");
  return 0;
}
