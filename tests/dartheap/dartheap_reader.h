// An independent reader of the dartheap format (the Dart VM heap snapshot that DevTools loads),
// written from the format's published description and the notes on what the real readers do,
// without sharing code with the writer in tools/dartheap/. Parse() rejects what would break the
// real readers' parsing; Check() reports every other invariant a writer must keep for the tools
// to work (reachability, exact counts, identity hashes, class filters...).
#ifndef HEAPDUMP_TESTS_DARTHEAP_READER_H
#define HEAPDUMP_TESTS_DARTHEAP_READER_H

#include <cstdint>
#include <string>
#include <vector>

namespace dartheap {

struct Field {
  uint64_t flags = 0;
  uint64_t index = 0;
  std::string name;
  std::string reserved;
};

struct Class {
  uint64_t flags = 0;
  std::string name;
  std::string library_name;
  std::string library_uri;
  std::string reserved;
  std::vector<Field> fields;
  // The library as DevTools shows and filters it: the name, or the URI if the name is empty.
  const std::string &Library() const { return library_name.empty() ? library_uri : library_name; }
};

// The non-reference data of an object (tags 0-8).
enum class DataTag : uint64_t {
  kNone = 0,
  kNull = 1,
  kBool = 2,
  kInt = 3,
  kDouble = 4,
  kLatin1 = 5,
  kUtf16 = 6,
  kLength = 7,
  kName = 8,
};

struct Data {
  DataTag tag = DataTag::kNone;
  uint64_t value = 0;           // bool, int, length; a string's full length
  double number = 0;            // double
  std::string text;             // name, latin1 code units
  std::vector<uint16_t> utf16;  // utf16 code units
};

struct Object {
  uint64_t class_id = 0;
  uint64_t shallow_size = 0;
  Data data;
  std::vector<uint64_t> references;  // object ids; 0 means an omitted target
};

struct ExternalProperty {
  uint64_t object = 0;
  uint64_t external_size = 0;
  std::string name;
};

struct Graph {
  uint64_t flags = 0;
  std::string name;
  uint64_t shallow_size = 0;
  uint64_t capacity = 0;
  uint64_t external_size = 0;
  std::vector<Class> classes;  // classes[i] has class id i + 1
  uint64_t reference_count = 0;
  std::vector<Object> objects;  // objects[i] has object id i + 1; object 1 is the root
  std::vector<ExternalProperty> external_properties;
  bool has_identity_hashes = false;
  std::vector<uint64_t> identity_hashes;  // identity_hashes[i] is object id i + 1's

  // Accessors by 1-origin id; the id must be valid (Check() verifies the graph's ids).
  const Object &object(uint64_t id) const { return objects.at(id - 1); }
  const Class &class_of(uint64_t object_id) const {
    return classes.at(object(object_id).class_id - 1);
  }
  uint64_t identity_hash(uint64_t object_id) const { return identity_hashes.at(object_id - 1); }
};

// Parses a whole file. Returns false with a reason (and the byte offset) if the bytes are not a
// well-formed dartheap file: bad magic, malformed or over-long varint, truncation, unknown tag,
// a bool byte other than 0/1, an identity hash section of the wrong length, trailing bytes.
bool Parse(const std::string &bytes, Graph *graph, std::string *error);
bool ReadFile(const std::string &path, Graph *graph, std::string *error);

// Every invariant the notes list beyond well-formedness; an empty result means none is broken.
// Each problem is one readable line.
std::vector<std::string> Check(const Graph &graph);

// Check()'s problems joined with newlines, for test messages.
std::string CheckReport(const Graph &graph);

// Object ids reachable from the root (object 1), in breadth-first order.
std::vector<uint64_t> Reachable(const Graph &graph);

}  // namespace dartheap

#endif
