/* A C program (no libstdc++ of its own) that loads a C++ module with dlopen, as an interpreter
 * loads an extension: argv[1] is the module (guest_module.cc). Prints whether libstdc++ was in
 * the process before the module brought it, then what the module's functions returned. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

static int mapped(const char *library) {
  FILE *maps = fopen("/proc/self/maps", "r");
  char line[512];
  int found = 0;
  while (maps && !found && fgets(line, sizeof line, maps)) found = strstr(line, library) != NULL;
  if (maps) fclose(maps);
  return found;
}

int main(int argc, char **argv) {
  if (argc != 2) return 2;
  printf("libstdc++ before the module: %s\n", mapped("libstdc++") ? "yes" : "no");
  void *module = dlopen(argv[1], RTLD_NOW);
  if (!module) return 3;
  int (*make_strings)(int) = (int (*)(int))dlsym(module, "guest_make_strings");
  int (*exercise_new)(void) = (int (*)(void))dlsym(module, "guest_exercise_new");
  if (!make_strings || !exercise_new) return 4;
  printf("strings: %d\n", make_strings(1000));
  printf("new_handler calls: %d\n", exercise_new());
  return 0;
}
