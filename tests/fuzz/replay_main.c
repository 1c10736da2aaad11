/* Runs a fuzz target's LLVMFuzzerTestOneInput on every file of the given directories (its seed
 * corpus) once, so that the seeds are regression tests of every build, sanitized or not, not
 * only of the fuzzing build. A target aborts on what it finds wrong; this exits 1 if a file
 * cannot be read or no input was found. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int by_name(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Runs the input in path; false if it cannot be read. */
static int replay_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return 0;
  size_t capacity = 1 << 16, size = 0;
  uint8_t *data = malloc(capacity);
  size_t n;
  while (data != NULL && (n = fread(data + size, 1, capacity - size, f)) > 0) {
    size += n;
    if (size == capacity) {
      uint8_t *bigger = realloc(data, capacity *= 2);
      if (bigger == NULL) free(data);
      data = bigger;
    }
  }
  const int ok = data != NULL && !ferror(f);
  fclose(f);
  if (ok) LLVMFuzzerTestOneInput(data, size);
  free(data);
  return ok;
}

int main(int argc, char **argv) {
  size_t replayed = 0;
  for (int i = 1; i < argc; i++) {
    DIR *d = opendir(argv[i]);
    if (d == NULL) {
      fprintf(stderr, "replay: cannot open %s\n", argv[i]);
      return 1;
    }
    char **names = NULL;
    size_t count = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
      if (e->d_name[0] == '.') continue;
      names = realloc(names, (count + 1) * sizeof *names);
      if (names == NULL || (names[count] = strdup(e->d_name)) == NULL) return 1;
      count++;
    }
    closedir(d);
    qsort(names, count, sizeof *names, by_name);
    for (size_t k = 0; k < count; k++) {
      char path[4096];
      snprintf(path, sizeof path, "%s/%s", argv[i], names[k]);
      if (!replay_file(path)) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        return 1;
      }
      printf("replay: %s\n", path);
      replayed++;
      free(names[k]);
    }
    free(names);
  }
  if (replayed == 0) {
    fprintf(stderr, "replay: no input found\n");
    return 1;
  }
  printf("replay: %zu inputs, no failure\n", replayed);
  return 0;
}
