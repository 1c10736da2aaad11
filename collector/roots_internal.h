/* Between the parts of the roots' gathering (private to the collector): roots.c finds modules'
 * data, threads' stacks and TLS, and sends the roots; program_mappings.c adds the memory the
 * program mapped itself and takes out what is not the program's. */
#ifndef HEAPDUMP_COLLECTOR_ROOTS_INTERNAL_H
#define HEAPDUMP_COLLECTOR_ROOTS_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "collector_internal.h"
#include "heapdump/contract/shm_layout.h"

/* The main thread's TLS shares its mapping with what the loader allocated early; a mapping
 * bigger than this is read only around the thread pointer (static TLS below, the TCB above). */
#define TLS_WHOLE_MAPPING_MAX (1u << 20)
#define TLS_BELOW (256u << 10)
#define TLS_ABOVE (16u << 10)
/* glibc's thread control block (struct pthread) starts at the thread pointer; 2304 bytes on
 * x86-64 glibc 2.36, read with room to spare. */
#define TCB_SPAN 4096u

/* Bounds on what one snapshot's roots may cost the collector, whatever the process looks like
 * (a million mappings, a 64 GiB sparse one): the mappings kept from /proc/PID/maps, the
 * records of memory that is not the program's taken from its table, and the address space
 * whose residency is looked up (/proc/PID/pagemap, 8 bytes per page). Past them, what is left
 * is sent as roots not read, so that a leak check says its verdict is uncertain. */
#define MAX_MAPPINGS (1u << 18)
#define MAX_MAPPING_RECORDS 8192u
#define MAX_PAGEMAP_SPAN ((uint64_t)256 << 30)
/* A program mapping up to this size is read whole (its pages not looked up first). */
#define READ_WHOLE_MAX ((uint64_t)1 << 20)
/* Roots are read and sent in pieces of at most this size. */
#define ROOT_PIECE ((uint64_t)64 << 20)
#define PAGE_SIZE_BYTES 4096u

typedef struct mapping {
  uint64_t start, end, offset;
  char perms[5];
  char *path; /* "" for an anonymous mapping */
} mapping;

typedef struct root {
  uint64_t start, end;
  heapdump_client_RootKind kind;
  uint64_t tid;
  const char *name; /* a mapping's path, owned by the maps */
  bool not_read;    /* left out before reading: send as RootRegion.not_read */
} root;

/* Sorted, disjoint address ranges. */
typedef struct range {
  uint64_t start, end;
} range;
typedef struct range_set {
  range *items;
  size_t count, capacity;
} range_set;

typedef struct gather {
  mapping *maps;
  size_t map_count;
  root *roots;
  size_t root_count, root_capacity;
  hd_thread_roots *threads; /* the records, oldest first */
  size_t thread_count, thread_capacity;
  /* The stacks of the live threads, and which records belong to one. */
  struct stack_span {
    uint64_t lo, hi;
  } * live;
  size_t live_count, live_capacity;
  bool *record_alive; /* per record */
  /* Memory that is not the program's, as the process recorded it (hd_rec_mapping). */
  range_set allocator, heapdump;
  /* glibc's memory found in the mappings that hold recorded blocks (glibc_heap.c). */
  range_set glibc;
  /* The process does not record every block (sampled, or armed after it started). */
  bool unrecorded;
  struct tls_span {
    uint64_t offset, size; /* from each thread pointer (offset in two's complement) */
  } heapdump_tls[4];
  size_t heapdump_tls_count;
  bool brk_heap, blocks_mapped;
  bool records_cut;                        /* more mapping records than MAX_MAPPING_RECORDS */
  bool maps_cut;                           /* more mappings than MAX_MAPPINGS */
  uint64_t maps_cut_start, maps_cut_bytes; /* the writable mappings past the cut */
  uint64_t pagemap_left; /* address space whose residency may still be looked up */
  int pagemap_fd;
  bool out_of_memory;
} gather;

/* Makes room for one more item; false when out of memory (unchanged). */
bool hd_roots_grow(void **items, size_t count, size_t *capacity, size_t size);
/* Adds the root [start, end) (none if empty); not_read: left out before reading. */
void hd_roots_add_root_as(gather *g, uint64_t start, uint64_t end, heapdump_client_RootKind kind,
                          uint64_t tid, const char *name, bool not_read);
void hd_roots_add_root(gather *g, uint64_t start, uint64_t end, heapdump_client_RootKind kind,
                       uint64_t tid, const char *name);
/* The thread records, and the records of memory that is not the program's (allocator,
 * heapdump, heapdump_tls, brk_heap, blocks_mapped). */
void hd_roots_read_records(hd_process *p, gather *g);
/* Adds or removes [start, end) of s (kept sorted and disjoint); false when out of memory. */
bool hd_range_set_add(range_set *s, uint64_t start, uint64_t end);
bool hd_range_set_remove(range_set *s, uint64_t start, uint64_t end);

/* The blocks' addresses, sorted (malloc'd; NULL when out of memory). */
uint64_t *hd_roots_sorted_addresses(const hd_live_block *blocks, size_t count);

/* Reads size bytes of the process at address; false unless all were read. */
bool hd_roots_read_remote(pid_t pid, uint64_t address, void *out, size_t size);

/* ---- glibc_heap.c ---- */
/* For a process recording on glibc: where glibc's memory is among the mappings that hold
 * recorded blocks (g->glibc: its thread-arena heaps, its blocks mmapped on their own), and with
 * unrecorded (a process that does not record every block) the in-use chunks of its heaps that
 * hold no recorded block, as roots of kind UNRECORDED. addresses: the live blocks' (sorted). */
void hd_roots_glibc_heaps(pid_t pid, gather *g, const uint64_t *addresses, size_t block_count,
                          bool unrecorded);

/* ---- program_mappings.c ---- */

/* The index of the first of the (sorted) addresses >= start. */
size_t hd_roots_first_at_or_after(const uint64_t *addresses, size_t count, uint64_t start);
/* Whether a live block lies in [start, end) (addresses sorted). */
bool hd_roots_holds_block(const uint64_t *addresses, size_t count, uint64_t start, uint64_t end);

/* Every writable mapping that is neither a module's data, a thread's stack, the allocator's nor
 * heapdump's own, as roots: `taken` holds the roots found so far; addresses are the live blocks'
 * (sorted), for an allocator whose mappings are known only by the blocks they hold. */
void hd_roots_add_program_mappings(hd_process *p, gather *g, const range_set *taken,
                                   const uint64_t *addresses, size_t address_count);
/* Removes from the roots (sorted, disjoint) what is not the program's. */
void hd_roots_remove_not_the_programs(gather *g);

#endif
