/* Reachability of the live blocks of a snapshot that has block contents and roots (RootRegion),
 * with valgrind's leak categories: a conservative scan, where every aligned 8-byte word of a
 * root or of a scanned block that holds an address inside a live block is a pointer to it. */
#ifndef HEAPDUMP_TOOLS_REACH_H
#define HEAPDUMP_TOOLS_REACH_H

#include <stddef.h>
#include <stdint.h>

#include "heapdump/contract/must_check.h"
#include "heapdump/fidl/snapshot.h"

#ifdef __cplusplus
extern "C" {
#endif

/* In the order reports list them. */
typedef enum hd_reach_category {
  HD_DEFINITELY_LOST = 0, /* nothing reachable points to it */
  HD_INDIRECTLY_LOST,     /* only lost blocks point to it: a leaked object's members, the rest
                             of a leaked cycle */
  HD_POSSIBLY_LOST,       /* reached, but every chain to it has a pointer into a block's
                             interior */
  HD_STILL_REACHABLE,     /* a chain of pointers to blocks' starts reaches it from a root */
  HD_REACH_CATEGORIES,
} hd_reach_category;

/* "definitely_lost", "indirectly_lost", "possibly_lost", "still_reachable". */
const char *hd_reach_category_name(hd_reach_category c);

/* Whether s carries what a classification needs: roots (a snapshot taken with contents). */
bool hd_reach_possible(const hd_snapshot *s);

/* Classifies every allocation of s: categories[i] for s->allocations[i] (an hd_reach_category).
 * A block whose contents are missing (cut by a size limit, or unreadable) is taken to point
 * nowhere; *blocks_without_contents (nullable) counts them. Returns 0, -EINVAL if s has no
 * roots, or -ENOMEM. */
HD_MUST_CHECK int hd_reach_classify(const hd_snapshot *s, uint8_t *categories,
                                    size_t *blocks_without_contents);

#ifdef __cplusplus
}
#endif
#endif
