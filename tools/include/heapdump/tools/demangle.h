/* Readable names for the linkage names symbols carry: C++ (Itanium ABI) and Rust (legacy and
 * v0) names, demangled by libiberty (the demangler of GNU binutils and GDB, so names read as
 * c++filt and gdb print them). Not thread-safe. */
#ifndef HEAPDUMP_TOOLS_DEMANGLE_H
#define HEAPDUMP_TOOLS_DEMANGLE_H

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The demangled form of name, with its parameter list; name itself when it is not a mangled
 * name (a C function, or one the demangler rejects), NULL for NULL. A demangled string stays
 * valid until the process exits (each distinct name is demangled once). */
const char *hd_demangle(const char *name);
/* The same without the parameter list (and the qualifiers after it): "shop::make_basket". */
const char *hd_demangle_without_parameters(const char *name);

/* Whether a linkage name belongs to the C++ standard library's namespaces (std::, including
 * std::__cxx11::, and __gnu_cxx::), read from the mangled form. */
bool hd_is_std_library_name(const char *name);

#ifdef __cplusplus
}
#endif
#endif
