/* Shared-memory layout of the two heapdump tables: the single contract between the writer
 * (libheapdump.so, inside the profiled process) and every reader (collector/table_reader.c).
 *
 * TWO MEMFDS PER PROCESS, each starting with a header at offset 0 that carries a magic, a layout
 * version and its own size. Every field is fixed-width little-endian (heapdump runs on x86-64
 * only), every struct size and field offset is pinned at the end of this header with
 * _Static_assert, and all shared fields are accessed with __atomic builtins on plain integers (so
 * this header is valid C11 and C++17). memfds are created with MFD_ALLOW_SEALING, sized once to
 * their cap (sparse: a page is committed when first written) and sealed F_SEAL_SHRINK |
 * F_SEAL_GROW, so a reader's mapping can never lose pages; a reader refuses a memfd without
 * F_SEAL_SHRINK. Live tables are not sealed F_SEAL_SEAL: a snapshot copy is made the same way and
 * then sealed F_SEAL_WRITE | F_SEAL_SEAL, and seals can only ever be added, so leaving F_SEAL_SEAL
 * off takes nothing from a reader. A named snapshot's copy must carry F_SEAL_WRITE | F_SEAL_SHRINK
 * | F_SEAL_GROW and HD_ALLOC_FLAG_SNAPSHOT, or the collector refuses it.
 *
 *   allocations table                         resources table
 *   +--------------------------+ 0            +------------------------+ 0
 *   | hd_alloc_header          |              | hd_res_header (stats)  |
 *   +--------------------------+ seq_offset   +------------------------+ records_offset
 *   | u32 slot_seq[4096]       |              | record | record | ...   | append-only log,
 *   +--------------------------+ nodes_offset |   ...                  | 8-byte aligned records;
 *   | hd_alloc_node[capacity]  |              |                        | key = byte offset
 *   +--------------------------+ total_size   +------------------------+ used (published)
 *                                             |   (unwritten, sparse)  |
 *                                             +------------------------+ total_size
 *
 * ALLOCATIONS TABLE: an array of nodes, one per live block. A node holds a block's record from
 * the block's allocation to its free and never moves; it is live exactly when its address_word
 * is non-zero. The writer finds a block's node from the block itself (it keeps the index in the
 * block, out of the program's sight), so the table has no index a reader must follow. Nodes
 * [0, node_high_water) have been handed out; node_high_water only grows, by compare-and-swap
 * (relaxed: a node's contents are only published through W3); free nodes are linked through
 * their `next` fields, which readers ignore. Every HD_NODES_PER_SLOT consecutive nodes belong to
 * one sequence slot: slot = (index / HD_NODES_PER_SLOT) & (HD_SEQ_SLOTS - 1). The slot's u32
 * counter is both the writers' spinlock and the readers' seqlock: writer (any change to a node of
 * slot s: insert, erase, in-place replace): W1  CAS slot_seq[s] even -> odd (__ATOMIC_ACQUIRE: lock
 * between writers)
 *         __atomic_thread_fence(__ATOMIC_RELEASE) (odd value ordered before the data stores)
 *     W2  relaxed stores to the node: an insert stores the payload before the address_word, an
 *         erase stores address_word = 0
 *     W3  store slot_seq[s] = odd + 1            (__ATOMIC_RELEASE: unlock, publishes W2)
 *   reader (per run of HD_NODES_PER_SLOT nodes, in index order, below node_high_water as read
 *   when the copy starts):
 *     R1  s1 = load slot_seq[s]                  (__ATOMIC_ACQUIRE, pairs with W3); odd: retry
 *     R2  relaxed loads: copy every node of the run whose address_word is non-zero
 *     R3  __atomic_thread_fence(__ATOMIC_ACQUIRE) then s2 = load slot_seq[s] (__ATOMIC_RELAXED);
 *         s1 != s2: discard the run's copy, retry (bounded; give up with a "busy" error)
 *   A FINAL table — a snapshot copy (sealed F_SEAL_WRITE) or the table of a process that has
 *   exited — cannot change: a reader takes an odd slot as its dead writer left it (no retry).
 *
 * SNAPSHOT CONSISTENCY (what the collector relies on, with a read-only mapping and no pause):
 * each run's copy is exactly the state of its nodes at one instant inside the snapshot, and a
 * block's record stays in one node from its allocation to its free. Hence a block live during
 * the whole snapshot is copied exactly once; a block freed before the snapshot began is in no
 * node by then. A block freed while the copy runs may be met, and a block allocated again at its
 * address may be met too, in a later node: the copy then holds one address twice, and the
 * reader keeps the newer record (as it does of an address that a hostile table records twice).
 * Writers never wait for readers; a reader retries a run only when a writer changed its slot
 * meanwhile. A realloc that stays in place rewrites its node inside one W1..W3 section, so it
 * is never seen absent or twice; a moving realloc is a new block plus the free of the old one.
 *
 * RESOURCES TABLE: append-only records, never modified after publication except the two atomic
 * counters of a stack-trace record, the counters of a HD_REC_COUNTERS record and the header
 * statistics. Writers (serialised by a private mutex) write a record at offset `used`, then store
 * `used` += record size
 * (__ATOMIC_RELEASE). Readers load `used` (__ATOMIC_ACQUIRE) and may then read any record below
 * it. A key (stack trace, thread info) is the byte offset of its record; 0 means "none".
 * Counters and statistics are updated with relaxed atomics and read with relaxed loads; they
 * are monotonic but not mutually consistent at any instant. Process statistics are the header's
 * base plus the sum of the per-thread HD_REC_COUNTERS records (see there); a reader follows
 * that list from counters_head, bounded by the record count and the published end.
 *
 * STACK TRACE ENCODING: frame i (return addresses, innermost first) is stored as
 * zigzag(frame[i] - frame[i-1]) (frame[-1] = 0, two's-complement 64-bit difference) in LEB128
 * varint form (7 bits per byte, high bit = more).
 *
 * Every reader must treat all of this memory as hostile: copy, then bounds-check every offset,
 * length, index and count before use.
 */
#ifndef HEAPDUMP_CONTRACT_SHM_LAYOUT_H
#define HEAPDUMP_CONTRACT_SHM_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#define HD_STATIC_ASSERT static_assert
#else
#define HD_STATIC_ASSERT _Static_assert
#endif

#define HD_LAYOUT_VERSION 10u
/* Every live block the library records holds this many bytes more than the program asked for,
 * at the end of its usable size: the tag that links it to its node (instrumentation/src/record.c).
 * They are heapdump's own memory inside the allocator's. */
#define HD_TAG_BYTES 8u
#define HD_ALLOC_MAGIC UINT64_C(0x31434f4c4c414448) /* "HDALLOC1" little-endian */
#define HD_RES_MAGIC UINT64_C(0x3153455243534448)   /* "HDSCRES1" little-endian */

/* Sequence slots (power of two). 4096 of them (16 KiB) stay in a core's cache; two writers
 * rarely meet on one. */
#define HD_SEQ_SLOTS 4096u
/* Consecutive nodes guarded by one slot: a reader copies them under one read of the slot, and a
 * writer thread takes nodes from the never-used range this many at a time, so its own nodes
 * share slots with no other thread's. */
#define HD_NODES_PER_SLOT 16u
static inline uint32_t hd_node_slot(uint32_t index) {
  return (index / HD_NODES_PER_SLOT) & (HD_SEQ_SLOTS - 1);
}
#define HD_MAX_FRAMES 64u /* hard cap of frames per trace */
/* No table's memfd is larger (over a billion live blocks): a reader refuses a bigger one before
 * mapping it, so a process cannot make a collector map unbounded address space. */
#define HD_MAX_TABLE_BYTES (UINT64_C(64) << 30)
#define HD_MAX_BUILD_ID 32u
#define HD_THREAD_NAME_MAX 16u /* Linux comm length incl. NUL */
#define HD_REGION_NAME_MAX 4096u

/* hd_alloc_header.flags */
#define HD_ALLOC_FLAG_SNAPSHOT 1u /* a frozen copy (sealed F_SEAL_WRITE), not a live table */
/* Only recorded blocks carry a tag: the blocks sampling left out (sampled on glibc) have none. */
#define HD_ALLOC_FLAG_UNRECORDED_UNTAGGED 2u

typedef struct hd_alloc_header {
  uint64_t magic;          /* HD_ALLOC_MAGIC */
  uint32_t version;        /* HD_LAYOUT_VERSION */
  uint32_t header_size;    /* sizeof(hd_alloc_header) */
  uint64_t total_size;     /* memfd size; every offset below is < total_size */
  uint32_t node_size;      /* sizeof(hd_alloc_node) */
  uint32_t flags;          /* HD_ALLOC_FLAG_* */
  uint32_t seq_slots;      /* HD_SEQ_SLOTS */
  uint32_t nodes_per_slot; /* HD_NODES_PER_SLOT */
  uint32_t reserved1[2];
  uint32_t node_capacity;   /* nodes that fit; indices are < node_capacity < 2^32 - 1 */
  uint32_t node_high_water; /* atomic; nodes ever handed out */
  uint64_t seq_offset;      /* u32[seq_slots] */
  uint64_t reserved2;
  uint64_t nodes_offset; /* hd_alloc_node[node_capacity] */
  uint64_t time_base;    /* CLOCK_MONOTONIC ns that every node's time offset is added to */
  uint32_t pid;          /* process that wrote the table */
  uint32_t reserved0;
  /* A frozen copy (HD_ALLOC_FLAG_SNAPSHOT): the resources table's peak_mark when the copy was
   * made, so that a reader pairs the copy's blocks with that mark (0: none, and in a live table) */
  uint64_t snapshot_peak_mark;
  uint64_t reserved[5];
} hd_alloc_header;

/* One live block in 32 bytes. Addresses and sizes below 2^48 are recorded (user space on x86-64
 * is below 2^47 unless a program maps above it on purpose, and no larger block can be
 * allocated); the writer leaves any other block unrecorded, counted as dropped. */
typedef struct hd_alloc_node {
  uint32_t next;         /* the writer's: link (index + 1) of the next free node while this one
                            is free; readers ignore it */
  uint32_t thread_key;   /* resources-table offset of a HD_REC_THREAD record, 0 if none */
  uint32_t stack_key;    /* resources-table offset of a HD_REC_STACK record, 0 if none */
  uint32_t size_low;     /* bits 0..31 of the requested size in bytes */
  uint64_t address_word; /* bits 0..47: the block's address (0: the node is free);
                            bits 48..63: bits 32..47 of the requested size */
  uint64_t time_word;    /* bits 0..55: CLOCK_MONOTONIC ns at allocation minus the header's
                            time_base (kept at 0 and 2^56 - 1 if it falls outside, which takes a
                            process 2.28 years); bits 56..63: log2 of the requested alignment
                            (0 = default) */
} hd_alloc_node;

#define HD_NODE_ALIGN_MASK 0xffu
#define HD_NODE_ADDRESS_BITS 48
#define HD_NODE_ADDRESS_MASK ((UINT64_C(1) << HD_NODE_ADDRESS_BITS) - 1)
#define HD_NODE_TIME_MASK ((UINT64_C(1) << 56) - 1)

/* Whether a block of this address and size fits a node. */
static inline int hd_node_representable(uint64_t address, uint64_t size) {
  return ((address | size) >> HD_NODE_ADDRESS_BITS) == 0;
}
static inline uint64_t hd_node_address(uint64_t address_word) {
  return address_word & HD_NODE_ADDRESS_MASK;
}
static inline uint64_t hd_node_size(uint32_t size_low, uint64_t address_word) {
  return (uint64_t)size_low | (address_word >> HD_NODE_ADDRESS_BITS) << 32;
}
static inline uint64_t hd_node_address_word(uint64_t address, uint64_t size) {
  return address | (size >> 32) << HD_NODE_ADDRESS_BITS;
}
static inline uint64_t hd_node_timestamp(uint64_t time_word, uint64_t time_base) {
  return time_base + (time_word & HD_NODE_TIME_MASK);
}

/* Sampled recording (hd_res_header.sample_bytes = N > 0). Allocated bytes are sampled by a
 * Poisson process of mean interval N, so an allocation of s bytes is recorded with probability
 * p = 1 - e^(-s/N), and a recorded one stands for 1/p blocks (and s/p bytes): the unbiased
 * (Horvitz-Thompson) estimate. It is counted as an integer k of blocks of s bytes, floor(1/p)
 * or the next integer, chosen by a hash of the block's address and allocation time (a loop that
 * gets the same address back each time still rounds each block its own way) so that k averages
 * 1/p over blocks, and the free of a block takes back exactly what its allocation added. Both the
 * library and the collector compute it here, in plain double arithmetic (no libm, whose versions
 * could round differently), so they agree on every block. N = 0: every block is recorded, k = 1. */
static inline double hd_sample_probability(uint64_t size, uint64_t sample_bytes) {
  const double x = (double)size / (double)sample_bytes;
  if (x >= 40) return 1; /* e^-40 is below a double's precision next to 1 */
  if (x < 0.5) {         /* 1 - e^-x = x - x^2/2! + x^3/3! - ...: no cancellation */
    double term = x, sum = x;
    for (int i = 2; i <= 18; i++) {
      term *= -x / i;
      sum += term;
    }
    return sum;
  }
  /* e^-x = 2^-n e^-r with x = n ln 2 + r, 0 <= r < ln 2 */
  const double ln2 = 0.69314718055994530942;
  const int n = (int)(x / ln2);
  const double r = x - n * ln2;
  double term = 1, e = 1;
  for (int i = 1; i <= 20; i++) {
    term *= -r / i;
    e += term;
  }
  for (int i = 0; i < n; i++) e *= 0.5;
  return 1 - e;
}

/* The largest sample_bytes: an interval far past any heap, with which a weight times a block's
 * size (< 2^48) stays far from overflowing. */
#define HD_MAX_SAMPLE_BYTES (UINT64_C(1) << 40)

/* timestamp: the block's, as its node keeps it (hd_node_timestamp). */
static inline uint64_t hd_sample_weight(uint64_t address, uint64_t timestamp, uint64_t size,
                                        uint64_t sample_bytes) {
  if (sample_bytes == 0 || size == 0) return 1;
  const double w = 1 / hd_sample_probability(size, sample_bytes);
  if (w >= 18446744073709549568.0) return UINT64_MAX;
  uint64_t k = (uint64_t)w;
  const double frac = w - (double)k;
  uint64_t h = (address ^ timestamp * UINT64_C(0x9E3779B97F4A7C15)) * UINT64_C(0xBF58476D1CE4E5B9);
  h ^= h >> 31;
  h *= UINT64_C(0x94D049BB133111EB);
  h ^= h >> 29;
  /* 53 uniform bits against the fraction */
  if ((double)(h >> 11) * (1.0 / 9007199254740992.0) < frac) k++;
  return k;
}

/* Peak marks (hd_res_header.peak_mark) and the counts tagged with a mark's number. */
#define HD_PEAK_TIME_SHIFT 8u
#define HD_PEAK_VALUE_MASK ((UINT64_C(1) << 48) - 1)
static inline uint32_t hd_peak_mark_number(uint64_t word) { return (uint32_t)(word >> 48); }
static inline uint64_t hd_peak_mark_value(uint64_t word) { return word & HD_PEAK_VALUE_MASK; }
/* A timestamp (CLOCK_MONOTONIC ns) in the units of a mark's time. */
static inline uint64_t hd_peak_time_units(uint64_t timestamp, uint64_t start_time_ns) {
  uint64_t units =
      timestamp < start_time_ns ? 0 : (timestamp - start_time_ns) >> HD_PEAK_TIME_SHIFT;
  return units > HD_PEAK_VALUE_MASK ? HD_PEAK_VALUE_MASK : units;
}
/* Whether a block allocated at timestamp counts as live at the mark (if it was live then). */
static inline int hd_peak_allocated_by(uint64_t timestamp, uint64_t start_time_ns, uint64_t mark) {
  return hd_peak_mark_number(mark) != 0 &&
         hd_peak_time_units(timestamp, start_time_ns) <= hd_peak_mark_value(mark);
}
static inline uint32_t hd_node_align_log2(uint64_t time_word) {
  return (uint32_t)(time_word >> 56);
}
static inline uint64_t hd_node_time_word(uint64_t timestamp, uint64_t time_base,
                                         uint32_t align_log2) {
  uint64_t offset = timestamp < time_base ? 0 : timestamp - time_base;
  if (offset > HD_NODE_TIME_MASK) offset = HD_NODE_TIME_MASK;
  return offset | (uint64_t)(align_log2 & HD_NODE_ALIGN_MASK) << 56;
}

/* Process-wide statistics, in the resources header. All atomic, relaxed. The four allocated /
 * freed counters here are only a base: the totals are these plus the sums over every
 * HD_REC_COUNTERS record (modulo 2^64; the base can be "negative" after a fork). */
typedef struct hd_stats_block {
  uint64_t blocks_allocated; /* recorded allocations since start */
  uint64_t bytes_allocated;
  uint64_t blocks_freed; /* frees of recorded blocks */
  uint64_t bytes_freed;
  uint64_t peak_live_bytes;      /* maximum of bytes_allocated - bytes_freed */
  uint64_t dropped_allocations;  /* allocations not recorded: allocations table full, or a
                                    thread's queue of records from signal handlers full */
  uint64_t dropped_stack_traces; /* traces not stored (key 0 used): resources table full, or
                                    its lock busy in a signal handler */
  uint64_t dropped_resources;    /* thread infos / regions not stored: resources table full */
} hd_stats_block;

typedef struct hd_res_header {
  uint64_t magic;          /* HD_RES_MAGIC */
  uint32_t version;        /* HD_LAYOUT_VERSION */
  uint32_t header_size;    /* sizeof(hd_res_header) */
  uint64_t total_size;     /* memfd size */
  uint64_t records_offset; /* first record */
  uint64_t used;           /* atomic; end of the published records (release/acquire) */
  uint32_t pid;
  /* HD_ARM_*: whether the process records since it started, or since a collector armed it (the
   * dormant library, contract/arm_page.h), or records nothing new since it was disarmed. Zero
   * in a table whose writer did not know the field (it was reserved, so zero). Atomic. */
  uint32_t arm_state;
  uint64_t start_time_ns; /* CLOCK_MONOTONIC when the table was created */
  hd_stats_block stats;
  uint32_t counters_head; /* atomic (release/acquire): newest HD_REC_COUNTERS record, 0 = none */
  /* Atomic, relaxed: HD_REC_MAPPING records the writer could not write (its table full, or too
   * many waiting for the resources lock): the mappings of the allocator and of heapdump are then
   * not all known, and a reader must take a leak check's roots as uncertain. Zero in a table
   * whose writer did not know the field (it was reserved, so zero). */
  uint32_t mapping_records_lost;
  /* Atomic, relaxed: allocations whose stack our unwinder (HEAPDUMP_UNWIND=cfi or compare) could
   * not describe by call-frame information alone: a frame of code without any was stepped by
   * its frame pointer, or the trace ends at a frame it could not describe (with compare, libunwind
   * unwound those). Zero with any other unwinder, and in a table whose writer did not know the
   * field (it was reserved, so zero). */
  uint64_t stacks_beyond_cfi;
  /* Atomic, relaxed: frees of blocks whose tag (the end of the block, past what the program
   * asked for) had been overwritten: the program wrote past the end of those blocks. */
  uint64_t overwritten_tags;
  /* Atomic, relaxed: loaded modules whose unwind tables (.eh_frame_hdr, .eh_frame) were refused
   * as inconsistent: their frames are stepped by frame pointers, and libunwind is not shown
   * them. Zero in a table whose writer did not know the field (it was reserved, so zero). */
  uint32_t unwind_tables_refused;
  /* Atomic (release): the low 32 bits of the arm page's generation (contract/arm_page.h) whose
   * request the process acted on last, so that a client that made a request knows when the
   * process has acted on it. Zero in a table whose writer did not know the field. */
  uint32_t arm_generation;
  /* The latest peak mark (hd_peak_mark_*): the moment the live bytes last rose 1% past the
   * previous mark, so that the highest live bytes ever are within 1% of the mark's. Bits 48..63:
   * the mark's number (1, 2, ...; wraps past 65535 to 1; 0 = no mark yet); bits 0..47: its time,
   * in units of 2^HD_PEAK_TIME_SHIFT ns since start_time_ns. The blocks live at the mark are those
   * allocated at or before it (by the same units) that were live then: the live ones a reader
   * finds with such a timestamp, and those each hd_rec_stack counts in peak_freed_*. Atomic. */
  uint64_t peak_mark;
  uint64_t peak_mark_bytes; /* atomic: the live bytes when the mark was set */
  /* Sampled recording (hd_sample_weight): the mean number of allocated bytes between two
   * recorded blocks; 0 = every block recorded. Set before the first record, never changed. Every
   * count of this table (stats, counters records, hd_rec_stack's) is then an estimate: each
   * recorded block counted as the hd_sample_weight blocks it stands for. */
  uint64_t sample_bytes;
  /* Atomic, relaxed, signed (two's complement): the bytes of live blocks that have no record
   * because they were allocated before the process was armed or while it was disarmed, as
   * glibc's statistics count them (chunk headers included): set when armed from glibc's
   * mallinfo2, less each such block freed. An estimate; a reader takes a negative value as 0.
   * Zero in a table whose writer did not know the field (it was reserved, so zero). */
  uint64_t unattributed_bytes;
} hd_res_header;

enum {
  HD_ARM_FROM_START = 0, /* recording since the process started */
  HD_ARM_ARMED = 1,      /* dormant, then armed: recording blocks allocated since */
  HD_ARM_DISARMED = 2,   /* armed, then disarmed: recording no new block */
};

/* Every record starts with this; size is the whole record incl. header and padding, a
 * multiple of 8. */
enum {
  HD_REC_STACK = 1,
  HD_REC_THREAD = 2,
  HD_REC_REGION = 3,
  HD_REC_COUNTERS = 4,
  HD_REC_THREAD_ROOTS = 5, /* added within layout version 4: older readers skip it */
  HD_REC_MAPPING = 6,      /* added within layout version 6: older readers skip it */
};
typedef struct hd_rec_header {
  uint16_t type;
  uint16_t reserved;
  uint32_t size;
} hd_rec_header;

typedef struct hd_rec_stack {
  hd_rec_header h;
  /* The next three are atomic, and each is a part of its count: the threads' counters records
   * hold the rest (hd_pending_trace). */
  uint64_t alloc_blocks; /* blocks allocated with this trace since start */
  uint64_t alloc_bytes;  /* bytes allocated with this trace since start */
  /* blocks of this trace freed by the thread that allocated them before that thread allocated or
   * freed anything else (temporary allocations) */
  uint64_t temporary_blocks;
  /* atomic: blocks (bytes) of this trace live at the peak mark whose number is in bits 48..63
   * and freed since (bits 0..47); a count tagged with an older mark's number is 0 */
  uint64_t peak_freed_blocks;
  uint64_t peak_freed_bytes;
  uint16_t frame_count; /* <= HD_MAX_FRAMES */
  uint16_t flags;       /* HD_STACK_*; readers ignore bits they do not know */
  uint32_t encoded_len; /* bytes of varint data that follow */
  /* uint8_t encoded[encoded_len]; then padding to 8 */
} hd_rec_stack;
/* The walk stopped at the frame limit with frames left: the root-most frames are missing. A
 * truncated trace and a whole one with the same frames are distinct records. */
#define HD_STACK_TRUNCATED 1u

typedef struct hd_rec_thread {
  hd_rec_header h;
  uint32_t tid;
  uint32_t reserved;
  uint64_t timestamp;            /* when this name was first seen */
  char name[HD_THREAD_NAME_MAX]; /* NUL-terminated unless corrupt */
} hd_rec_thread;

/* Where a thread's memory is, for a reachability analysis (its stack and TLS are roots): one
 * record per thread, written at its first allocation. A reader takes the last record of a tid
 * that is still alive (tids are reused). */
typedef struct hd_rec_thread_roots {
  hd_rec_header h;
  uint32_t tid;
  uint32_t reserved;
  uint64_t stack_lo, stack_hi; /* the thread's stack (pthread_getattr_np); both 0 if unknown */
  uint64_t thread_pointer;     /* its thread control block, where its static TLS ends (x86-64:
                                  the fs base) */
} hd_rec_thread_roots;

/* Memory that is not the program's, for a leak check, which takes the program's own mappings
 * as roots: each record says that [start, start + size) was mapped (mapped = 1) or unmapped
 * (mapped = 0); a reader applies them in the order of the log. Kinds:
 * - HD_MAPPING_ALLOCATOR: the allocator's memory (jemalloc's mappings: its extents and its own
 *   metadata), which holds the blocks, free or not, never a root;
 * - HD_MAPPING_HEAPDUMP: heapdump's own memory in the process (its private indexes, its module's
 *   writable data, which holds the jemalloc linked into it);
 * - HD_MAPPING_HEAPDUMP_TLS: heapdump's static TLS in every thread: start is its offset from the
 *   thread pointer (two's complement), size its length;
 * - HD_MAPPING_BRK_HEAP: the program break's heap is the allocator's (glibc's main arena, with
 *   HEAPDUMP_ALLOCATOR=system); start and size are 0, as the kernel knows the range;
 * - HD_MAPPING_BLOCKS_MAPPED: the allocator maps blocks and arenas the writer cannot list
 *   (glibc's), so a mapping that holds a live block is the allocator's (start, size 0). */
enum {
  HD_MAPPING_ALLOCATOR = 1,
  HD_MAPPING_HEAPDUMP = 2,
  HD_MAPPING_HEAPDUMP_TLS = 3,
  HD_MAPPING_BRK_HEAP = 4,
  HD_MAPPING_BLOCKS_MAPPED = 5,
};
typedef struct hd_rec_mapping {
  hd_rec_header h;
  uint32_t kind;   /* HD_MAPPING_*; readers skip kinds they do not know */
  uint32_t mapped; /* 1: mapped, 0: unmapped */
  uint64_t start;
  uint64_t size;
} hd_rec_mapping;

typedef struct hd_rec_region {
  hd_rec_header h;
  uint64_t address;     /* runtime start of the executable segment */
  uint64_t size;        /* p_memsz */
  uint64_t file_offset; /* p_offset */
  uint64_t vaddr;       /* p_vaddr */
  uint8_t build_id[HD_MAX_BUILD_ID];
  uint8_t build_id_len; /* <= HD_MAX_BUILD_ID */
  uint8_t reserved[5];
  uint16_t name_len; /* bytes of name that follow (no NUL), < HD_REGION_NAME_MAX */
  /* char name[name_len]; then padding to 8 */
} hd_rec_region;

/* A thread's counts for one trace not yet added to the trace's record (hd_rec_stack): a trace's
 * alloc_blocks, alloc_bytes and temporary_blocks are its record's plus those of every counters
 * record's entry holding its key. */
typedef struct hd_pending_trace {
  uint32_t stack_key; /* 0: empty */
  uint32_t seq;       /* odd while the writer changes stack_key (hd_rec_counters) */
  uint64_t alloc_blocks;
  uint64_t alloc_bytes;
  uint64_t temporary_blocks;
} hd_pending_trace;
#define HD_PENDING_TRACES 16u
/* The one entry of a counters record that may hold trace stack_key. */
static inline uint32_t hd_pending_slot(uint32_t stack_key) {
  return (uint32_t)(stack_key * UINT32_C(0x9E3779B1)) >> 28; /* 28 = 32 - log2(HD_PENDING_TRACES) */
}

/* One thread's share of the allocated / freed statistics, and its counts of the traces it
 * allocated with last. Each record has exactly one writer at a time (the thread that owns it; a
 * record of an exited thread is handed to a new thread under the resources lock), which updates
 * the counters with relaxed atomic stores of load + n: no locked instruction on the allocation
 * path and no cache line shared between threads (several threads allocating with one trace
 * would otherwise all write its record). Records are linked newest first from
 * hd_res_header.counters_head through `next`; a new record is filled and published like any
 * other, then becomes the head (__ATOMIC_RELEASE store; readers load the head with
 * __ATOMIC_ACQUIRE). Records are never unlinked, so the sums only grow.
 *
 * An entry of `pending` changes its key only under its `seq`, a seqlock: the writer makes it
 * odd, adds the entry's counts to its old trace's record (atomic adds), writes the new key and
 * zero counts, and makes it even (__ATOMIC_RELEASE). So a reader of a trace's counts that reads
 * each entry holding its key (seq with acquire, even, then the counts), then the trace's record,
 * then those entries' seq again (after an acquire fence), and finds each unchanged, has counted
 * each of that trace's blocks once. */
typedef struct hd_rec_counters {
  hd_rec_header h;
  uint32_t next; /* offset of the next (older) counters record, 0 at the end */
  uint32_t
      writer_private; /* the writer's free list of records of exited threads; not for readers */
  uint64_t blocks_allocated;
  uint64_t bytes_allocated;
  uint64_t blocks_freed;
  uint64_t bytes_freed;
  hd_pending_trace pending[HD_PENDING_TRACES]; /* entry hd_pending_slot(key) holds key's */
} hd_rec_counters;

/* Every field's offset and every struct's size, pinned: a change to any of them is a layout
 * change (bump HD_LAYOUT_VERSION) and must be made here on purpose. */
#define HD_PIN(type, field, offset) \
  HD_STATIC_ASSERT(offsetof(type, field) == (offset), #type "." #field)
#define HD_PIN_SIZE(type, size) HD_STATIC_ASSERT(sizeof(type) == (size), #type " size")
HD_PIN(hd_alloc_header, magic, 0);
HD_PIN(hd_alloc_header, version, 8);
HD_PIN(hd_alloc_header, header_size, 12);
HD_PIN(hd_alloc_header, total_size, 16);
HD_PIN(hd_alloc_header, node_size, 24);
HD_PIN(hd_alloc_header, flags, 28);
HD_PIN(hd_alloc_header, seq_slots, 32);
HD_PIN(hd_alloc_header, nodes_per_slot, 36);
HD_PIN(hd_alloc_header, reserved1, 40);
HD_PIN(hd_alloc_header, node_capacity, 48);
HD_PIN(hd_alloc_header, node_high_water, 52);
HD_PIN(hd_alloc_header, seq_offset, 56);
HD_PIN(hd_alloc_header, reserved2, 64);
HD_PIN(hd_alloc_header, nodes_offset, 72);
HD_PIN(hd_alloc_header, time_base, 80);
HD_PIN(hd_alloc_header, pid, 88);
HD_PIN(hd_alloc_header, reserved0, 92);
HD_PIN(hd_alloc_header, snapshot_peak_mark, 96);
HD_PIN(hd_alloc_header, reserved, 104);
HD_PIN_SIZE(hd_alloc_header, 144);

HD_PIN(hd_alloc_node, next, 0);
HD_PIN(hd_alloc_node, thread_key, 4);
HD_PIN(hd_alloc_node, stack_key, 8);
HD_PIN(hd_alloc_node, size_low, 12);
HD_PIN(hd_alloc_node, address_word, 16);
HD_PIN(hd_alloc_node, time_word, 24);
HD_PIN_SIZE(hd_alloc_node, 32);

HD_PIN(hd_stats_block, blocks_allocated, 0);
HD_PIN(hd_stats_block, bytes_allocated, 8);
HD_PIN(hd_stats_block, blocks_freed, 16);
HD_PIN(hd_stats_block, bytes_freed, 24);
HD_PIN(hd_stats_block, peak_live_bytes, 32);
HD_PIN(hd_stats_block, dropped_allocations, 40);
HD_PIN(hd_stats_block, dropped_stack_traces, 48);
HD_PIN(hd_stats_block, dropped_resources, 56);
HD_PIN_SIZE(hd_stats_block, 64);

HD_PIN(hd_res_header, magic, 0);
HD_PIN(hd_res_header, version, 8);
HD_PIN(hd_res_header, header_size, 12);
HD_PIN(hd_res_header, total_size, 16);
HD_PIN(hd_res_header, records_offset, 24);
HD_PIN(hd_res_header, used, 32);
HD_PIN(hd_res_header, pid, 40);
HD_PIN(hd_res_header, arm_state, 44);
HD_PIN(hd_res_header, start_time_ns, 48);
HD_PIN(hd_res_header, stats, 56);
HD_PIN(hd_res_header, counters_head, 120);
HD_PIN(hd_res_header, mapping_records_lost, 124);
HD_PIN(hd_res_header, stacks_beyond_cfi, 128);
HD_PIN(hd_res_header, overwritten_tags, 136);
HD_PIN(hd_res_header, unwind_tables_refused, 144);
HD_PIN(hd_res_header, arm_generation, 148);
HD_PIN(hd_res_header, peak_mark, 152);
HD_PIN(hd_res_header, peak_mark_bytes, 160);
HD_PIN(hd_res_header, sample_bytes, 168);
HD_PIN(hd_res_header, unattributed_bytes, 176);
HD_PIN_SIZE(hd_res_header, 184);

HD_PIN(hd_rec_header, type, 0);
HD_PIN(hd_rec_header, reserved, 2);
HD_PIN(hd_rec_header, size, 4);
HD_PIN_SIZE(hd_rec_header, 8);

HD_PIN(hd_rec_stack, h, 0);
HD_PIN(hd_rec_stack, alloc_blocks, 8);
HD_PIN(hd_rec_stack, alloc_bytes, 16);
HD_PIN(hd_rec_stack, temporary_blocks, 24);
HD_PIN(hd_rec_stack, peak_freed_blocks, 32);
HD_PIN(hd_rec_stack, peak_freed_bytes, 40);
HD_PIN(hd_rec_stack, frame_count, 48);
HD_PIN(hd_rec_stack, flags, 50);
HD_PIN(hd_rec_stack, encoded_len, 52);
HD_PIN_SIZE(hd_rec_stack, 56);

HD_PIN(hd_rec_thread, h, 0);
HD_PIN(hd_rec_thread, tid, 8);
HD_PIN(hd_rec_thread, reserved, 12);
HD_PIN(hd_rec_thread, timestamp, 16);
HD_PIN(hd_rec_thread, name, 24);
HD_PIN_SIZE(hd_rec_thread, 40);

HD_PIN(hd_rec_thread_roots, h, 0);
HD_PIN(hd_rec_thread_roots, tid, 8);
HD_PIN(hd_rec_thread_roots, stack_lo, 16);
HD_PIN(hd_rec_thread_roots, stack_hi, 24);
HD_PIN(hd_rec_thread_roots, thread_pointer, 32);
HD_PIN_SIZE(hd_rec_thread_roots, 40);

HD_PIN(hd_rec_mapping, h, 0);
HD_PIN(hd_rec_mapping, kind, 8);
HD_PIN(hd_rec_mapping, mapped, 12);
HD_PIN(hd_rec_mapping, start, 16);
HD_PIN(hd_rec_mapping, size, 24);
HD_PIN_SIZE(hd_rec_mapping, 32);

HD_PIN(hd_rec_region, h, 0);
HD_PIN(hd_rec_region, address, 8);
HD_PIN(hd_rec_region, size, 16);
HD_PIN(hd_rec_region, file_offset, 24);
HD_PIN(hd_rec_region, vaddr, 32);
HD_PIN(hd_rec_region, build_id, 40);
HD_PIN(hd_rec_region, build_id_len, 72);
HD_PIN(hd_rec_region, reserved, 73);
HD_PIN(hd_rec_region, name_len, 78);
HD_PIN_SIZE(hd_rec_region, 80);

HD_PIN(hd_rec_counters, h, 0);
HD_PIN(hd_rec_counters, next, 8);
HD_PIN(hd_rec_counters, writer_private, 12);
HD_PIN(hd_rec_counters, blocks_allocated, 16);
HD_PIN(hd_rec_counters, bytes_allocated, 24);
HD_PIN(hd_rec_counters, blocks_freed, 32);
HD_PIN(hd_rec_counters, bytes_freed, 40);
HD_PIN(hd_rec_counters, pending, 48);
HD_PIN_SIZE(hd_rec_counters, 48 + 32 * HD_PENDING_TRACES);
HD_PIN(hd_pending_trace, stack_key, 0);
HD_PIN(hd_pending_trace, seq, 4);
HD_PIN(hd_pending_trace, alloc_blocks, 8);
HD_PIN(hd_pending_trace, alloc_bytes, 16);
HD_PIN(hd_pending_trace, temporary_blocks, 24);
HD_PIN_SIZE(hd_pending_trace, 32);

#undef HD_PIN
#undef HD_PIN_SIZE

#ifdef __cplusplus
}
#endif

#endif /* HEAPDUMP_CONTRACT_SHM_LAYOUT_H */
