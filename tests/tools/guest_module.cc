// A C++ module that C programs load (a Python extension, a plugin): its operator new and
// operator delete are those of the libstdc++ it brings, which a C program has not loaded before.
#include <cstddef>
#include <cstdint>
#include <new>
#include <string>
#include <vector>

namespace {

// Its destructor frees its vector's buffer and nothing else: at exit every string is lost, the
// string objects definitely (nothing points to them), their buffers indirectly.
struct Holder {
  std::vector<std::string *> strings;
  ~Holder() {}
};
Holder g_holder;

struct alignas(256) Aligned {
  char bytes[512];
};
int g_handler_calls;

void second_call_gives_up() {
  if (++g_handler_calls == 2) std::set_new_handler(nullptr);
}

}  // namespace

// new[] and aligned new, reachable through the module's data (globals the program could read,
// so that the stores stay).
extern "C" {
char *guest_array;
void *guest_aligned;
}

// n strings of 1,000 characters: n blocks of 32 bytes and n of 1,001.
extern "C" int guest_make_strings(int n) {
  for (int i = 0; i < n; i++) g_holder.strings.push_back(new std::string(1000, 'x'));
  return static_cast<int>(g_holder.strings.size());
}

// new[] (54,321 bytes) and aligned new (512 bytes, 256-aligned), both kept and zeroed (no stale
// pointer in them may reach another block); a sized delete and a sized aligned one; a
// nothrow new too big to succeed; and a new that fails twice through the new_handler, then
// throws. Returns how many times the handler ran (2), or -1 where the program's libstdc++ would
// have done otherwise.
extern "C" int guest_exercise_new(void) {
  guest_array = new char[54321]();
  auto *aligned = new Aligned();
  guest_aligned = aligned;
  if (reinterpret_cast<std::uintptr_t>(aligned) % 256 != 0) return -1;
  auto *sized = new std::string(2000, 'y');  // its buffer: operator delete(void *, size_t)
  delete sized;
  delete new Aligned();  // operator delete(void *, size_t, std::align_val_t)
  volatile std::size_t huge = std::size_t{1} << 60;
  if (new (std::nothrow) char[huge] != nullptr) return -1;
  std::set_new_handler(second_call_gives_up);
  try {
    char *never = new char[huge];
    delete[] never;
    return -1;
  } catch (const std::bad_alloc &) {
  }
  return g_handler_calls;
}
