// A C++ program with a known heap, for readable names and sites: a leaked shop::Basket owning a
// vector of strings, all built in shop::make_basket, though the allocations themselves are made
// in the C++ standard library (the strings by basic_string in libstdc++, the vector's buffer by
// std::vector's growth, instantiated here) or by operator new. Prints "ready <pid>", then waits
// for a line (or the end) of its input and exits 0.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

namespace shop {

struct Basket {
  std::vector<std::string> items;
};

// 10 live blocks, 608 bytes: the Basket (24), the vector's last buffer (8 strings of 32 bytes)
// and 8 strings of 40 characters (41 bytes each).
__attribute__((noinline)) Basket *make_basket(int items) {
  Basket *basket = new Basket;
  for (int i = 0; i < items; i++)
    basket->items.push_back(std::string(40, static_cast<char>('a' + i)));
  return basket;
}

}  // namespace shop

shop::Basket *volatile g_kept;

int main() {
  g_kept = shop::make_basket(8);
  std::printf("ready %d\n", static_cast<int>(getpid()));
  std::fflush(stdout);
  char line[16];
  (void)!std::fgets(line, sizeof line, stdin);
  return 0;
}
