// The independent dartheap reader (see dartheap_reader.h).
#include "dartheap_reader.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <sstream>
#include <unordered_set>

namespace dartheap {
namespace {

// JavaScript readers decode varints with 32-bit bitwise operators.
constexpr uint64_t kJsLimit = uint64_t{1} << 31;

class Cursor {
 public:
  explicit Cursor(const std::string &bytes)
      : data_(reinterpret_cast<const uint8_t *>(bytes.data())), size_(bytes.size()) {}

  bool AtEnd() const { return pos_ == size_; }
  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }
  const std::string &error() const { return error_; }

  bool Fail(const std::string &what) {
    if (error_.empty()) error_ = what + " at byte " + std::to_string(pos_);
    return false;
  }

  bool Byte(uint8_t *out, const char *what) {
    if (pos_ >= size_) return Fail(std::string("truncated: end of file in ") + what);
    *out = data_[pos_++];
    return true;
  }

  // Unsigned LEB128 of at most 64 bits.
  bool Uleb(uint64_t *out, const char *what) {
    uint64_t value = 0;
    for (int shift = 0;; shift += 7) {
      uint8_t b = 0;
      if (!Byte(&b, what)) return false;
      if (shift == 63 && (b & 0x7e) != 0) {
        return Fail(std::string("varint over 64 bits in ") + what);
      }
      value |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) break;
      if (shift == 63) return Fail(std::string("varint longer than 10 bytes in ") + what);
    }
    *out = value;
    return true;
  }

  bool Bytes(uint64_t count, std::string *out, const char *what) {
    if (count > remaining()) {
      return Fail(std::string("truncated: ") + what + " of " + std::to_string(count) +
                  " bytes with " + std::to_string(remaining()) + " left");
    }
    out->assign(reinterpret_cast<const char *>(data_ + pos_), count);
    pos_ += count;
    return true;
  }

  bool Utf8(std::string *out, const char *what) {
    uint64_t length;
    return Uleb(&length, what) && Bytes(length, out, what);
  }

  // A count of items of at least one byte each: larger than what is left means truncation (and
  // must not size an allocation).
  bool Count(uint64_t *out, const char *what) {
    if (!Uleb(out, what)) return false;
    if (*out > remaining()) {
      return Fail(std::string("truncated: ") + what + " " + std::to_string(*out) + " with " +
                  std::to_string(remaining()) + " bytes left");
    }
    return true;
  }

 private:
  const uint8_t *data_;
  size_t size_;
  size_t pos_ = 0;
  std::string error_;
};

bool ParseField(Cursor &c, Field *f) {
  return c.Uleb(&f->flags, "field flags") && c.Uleb(&f->index, "field index") &&
         c.Utf8(&f->name, "field name") && c.Utf8(&f->reserved, "field reserved string");
}

bool ParseClass(Cursor &c, Class *k) {
  uint64_t field_count;
  if (!c.Uleb(&k->flags, "class flags") || !c.Utf8(&k->name, "class name") ||
      !c.Utf8(&k->library_name, "class library name") ||
      !c.Utf8(&k->library_uri, "class library URI") ||
      !c.Utf8(&k->reserved, "class reserved string") || !c.Count(&field_count, "field count")) {
    return false;
  }
  k->fields.resize(field_count);
  for (Field &f : k->fields) {
    if (!ParseField(c, &f)) return false;
  }
  return true;
}

bool ParseData(Cursor &c, Data *d) {
  uint64_t tag;
  if (!c.Uleb(&tag, "data tag")) return false;
  if (tag > static_cast<uint64_t>(DataTag::kName)) {
    return c.Fail("unknown data tag " + std::to_string(tag));
  }
  d->tag = static_cast<DataTag>(tag);
  switch (d->tag) {
    case DataTag::kNone:
    case DataTag::kNull: return true;
    case DataTag::kBool: {
      uint8_t b = 0;
      if (!c.Byte(&b, "bool data")) return false;
      if (b > 1) return c.Fail("bool data byte " + std::to_string(b));
      d->value = b;
      return true;
    }
    case DataTag::kInt:
    case DataTag::kLength: return c.Uleb(&d->value, "int or length data");
    case DataTag::kDouble: {
      std::string bytes;
      if (!c.Bytes(8, &bytes, "double data")) return false;
      uint64_t bits = 0;
      for (int i = 7; i >= 0; i--) bits = bits << 8 | static_cast<uint8_t>(bytes[i]);
      std::memcpy(&d->number, &bits, sizeof bits);
      return true;
    }
    case DataTag::kLatin1: {
      uint64_t truncated;
      return c.Uleb(&d->value, "latin1 length") && c.Uleb(&truncated, "latin1 truncated length") &&
             c.Bytes(truncated, &d->text, "latin1 code units");
    }
    case DataTag::kUtf16: {
      uint64_t truncated;
      std::string bytes;
      if (!c.Uleb(&d->value, "utf16 length") || !c.Uleb(&truncated, "utf16 truncated length")) {
        return false;
      }
      if (truncated > c.remaining() / 2) return c.Fail("truncated: utf16 code units");
      if (!c.Bytes(truncated * 2, &bytes, "utf16 code units")) return false;
      d->utf16.resize(truncated);
      for (uint64_t i = 0; i < truncated; i++) {
        d->utf16[i] = static_cast<uint16_t>(static_cast<uint8_t>(bytes[2 * i]) |
                                            static_cast<uint8_t>(bytes[2 * i + 1]) << 8);
      }
      return true;
    }
    case DataTag::kName: return c.Utf8(&d->text, "name data");
  }
  return false;
}

bool ParseObject(Cursor &c, Object *o) {
  uint64_t count;
  if (!c.Uleb(&o->class_id, "object class id") || !c.Uleb(&o->shallow_size, "shallow size") ||
      !ParseData(c, &o->data) || !c.Count(&count, "object reference count")) {
    return false;
  }
  o->references.resize(count);
  for (uint64_t &r : o->references) {
    if (!c.Uleb(&r, "reference")) return false;
  }
  return true;
}

bool ParseGraph(Cursor &c, Graph *g) {
  std::string magic;
  if (!c.Bytes(8, &magic, "magic")) return false;
  if (magic != "dartheap") return c.Fail("bad magic (not a dartheap file)");
  uint64_t class_count, object_count, external_count;
  if (!c.Uleb(&g->flags, "flags") || !c.Utf8(&g->name, "name") ||
      !c.Uleb(&g->shallow_size, "shallow size") || !c.Uleb(&g->capacity, "capacity") ||
      !c.Uleb(&g->external_size, "external size") || !c.Count(&class_count, "class count")) {
    return false;
  }
  g->classes.resize(class_count);
  for (Class &k : g->classes) {
    if (!ParseClass(c, &k)) return false;
  }
  if (!c.Uleb(&g->reference_count, "reference count") || !c.Count(&object_count, "object count")) {
    return false;
  }
  g->objects.resize(object_count);
  for (Object &o : g->objects) {
    if (!ParseObject(c, &o)) return false;
  }
  if (!c.Count(&external_count, "external property count")) return false;
  g->external_properties.resize(external_count);
  for (ExternalProperty &p : g->external_properties) {
    if (!c.Uleb(&p.object, "external property object") ||
        !c.Uleb(&p.external_size, "external property size") ||
        !c.Utf8(&p.name, "external property name")) {
      return false;
    }
  }
  // The hash section is optional as a whole; when present it has exactly one entry per object.
  if (c.AtEnd()) return true;
  g->has_identity_hashes = true;
  g->identity_hashes.resize(object_count);
  for (uint64_t &h : g->identity_hashes) {
    if (!c.Uleb(&h, "identity hash codes")) return false;
  }
  if (!c.AtEnd()) return c.Fail(std::to_string(c.remaining()) + " trailing bytes");
  return true;
}

bool IsAlpha(char ch) { return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z'); }
bool IsDigit(char ch) { return ch >= '0' && ch <= '9'; }
bool IsHex(char ch) { return IsDigit(ch) || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F'); }

// An RFC 3986 URI reference: a valid scheme if any, only URI characters, and well-formed
// percent-escapes. (Brackets, valid only around an IPv6 host, are refused.)
bool IsUri(const std::string &s) {
  static const std::string kAllowed =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~:/?#@!$&'()*+,;=%";
  size_t first_delimiter = s.find_first_of("/?#");
  size_t colon = s.find(':');
  if (colon != std::string::npos && colon < first_delimiter) {
    if (colon == 0 || !IsAlpha(s[0])) return false;
    for (size_t i = 1; i < colon; i++) {
      if (!IsAlpha(s[i]) && !IsDigit(s[i]) && s[i] != '+' && s[i] != '-' && s[i] != '.') {
        return false;
      }
    }
  }
  if (std::count(s.begin(), s.end(), '#') > 1) return false;
  for (size_t i = 0; i < s.size(); i++) {
    if (kAllowed.find(s[i]) == std::string::npos) return false;
    if (s[i] == '%' && (i + 2 >= s.size() || !IsHex(s[i + 1]) || !IsHex(s[i + 2]))) {
      return false;
    }
  }
  return true;
}

std::string ObjectName(uint64_t id) { return "object " + std::to_string(id); }

}  // namespace

bool Parse(const std::string &bytes, Graph *graph, std::string *error) {
  *graph = Graph();
  Cursor c(bytes);
  if (ParseGraph(c, graph)) return true;
  *error = c.error();
  return false;
}

bool ReadFile(const std::string &path, Graph *graph, std::string *error) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *error = "cannot open " + path;
    return false;
  }
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return Parse(bytes, graph, error);
}

std::vector<uint64_t> Reachable(const Graph &graph) {
  std::vector<uint64_t> order;
  if (graph.objects.empty()) return order;
  std::vector<bool> seen(graph.objects.size() + 1);
  std::deque<uint64_t> queue{1};
  seen[1] = true;
  while (!queue.empty()) {
    uint64_t id = queue.front();
    queue.pop_front();
    order.push_back(id);
    for (uint64_t r : graph.objects[id - 1].references) {
      if (r == 0 || r > graph.objects.size() || seen[r]) continue;
      seen[r] = true;
      queue.push_back(r);
    }
  }
  return order;
}

std::vector<std::string> Check(const Graph &g) {
  std::vector<std::string> problems;
  auto problem = [&problems](const std::string &p) {
    // A broken writer can break an invariant a million times; the first ones tell the story.
    if (problems.size() < 50) problems.push_back(p);
  };
  auto js_value = [&problem](const std::string &what, uint64_t v) {
    if (v >= kJsLimit) {
      problem(what + " " + std::to_string(v) +
              " is not below 2^31 (JavaScript readers misread it)");
    }
  };
  const uint64_t n = g.objects.size();
  const uint64_t class_count = g.classes.size();

  if (g.flags != 0) problem("header flags " + std::to_string(g.flags) + " (must be 0)");
  js_value("header shallow size", g.shallow_size);
  js_value("header capacity", g.capacity);
  js_value("header external size", g.external_size);
  js_value("class count", class_count);
  js_value("object count", n);
  js_value("reference count", g.reference_count);
  js_value("external property count", g.external_properties.size());
  if (n == 0) {
    problem("no objects: object 1 must be the root");
    return problems;
  }

  // Classes.
  for (uint64_t k = 1; k <= class_count; k++) {
    const Class &c = g.classes[k - 1];
    std::string name = "class " + std::to_string(k) + " (" + c.name + ")";
    if (c.flags != 0) {
      problem(name + ": flags " + std::to_string(c.flags) + " (reserved, must be 0)");
    }
    if (!IsUri(c.library_uri)) {
      problem(name + ": library URI \"" + c.library_uri + "\" is not a URI");
    }
    js_value(name + " field count", c.fields.size());
    for (const Field &f : c.fields) js_value(name + " field index", f.index);
  }

  // Objects and references.
  uint64_t reference_sum = 0, shallow_sum = 0;
  std::vector<uint64_t> instances(class_count + 1);
  for (uint64_t id = 1; id <= n; id++) {
    const Object &o = g.objects[id - 1];
    std::string name = ObjectName(id);
    reference_sum += o.references.size();
    shallow_sum += o.shallow_size;
    js_value(name + " shallow size", o.shallow_size);
    js_value(name + " reference count", o.references.size());
    if (o.class_id == 0 || o.class_id > class_count) {
      problem(name + ": class id " + std::to_string(o.class_id) + " not in 1.." +
              std::to_string(class_count));
    } else {
      instances[o.class_id]++;
      for (const Field &f : g.classes[o.class_id - 1].fields) {
        if (f.index >= o.references.size()) {
          problem(name + ": field \"" + f.name + "\" of its class has index " +
                  std::to_string(f.index) + " but the object has " +
                  std::to_string(o.references.size()) + " references");
        }
      }
    }
    switch (o.data.tag) {
      case DataTag::kInt:
      case DataTag::kLength: js_value(name + " data value", o.data.value); break;
      case DataTag::kLatin1:
      case DataTag::kUtf16: {
        uint64_t truncated =
            o.data.tag == DataTag::kLatin1 ? o.data.text.size() : o.data.utf16.size();
        js_value(name + " string length", o.data.value);
        if (o.data.value < truncated) {
          problem(name + ": string length " + std::to_string(o.data.value) +
                  " below its truncated length " + std::to_string(truncated));
        }
        break;
      }
      default: break;
    }
    for (uint64_t r : o.references) {
      if (r > n) {
        problem(name + ": reference to object " + std::to_string(r) + " not in 0.." +
                std::to_string(n));
      } else if (r == 1) {
        problem(name + " references the root (object 1)");
      }
    }
  }
  if (reference_sum != g.reference_count) {
    problem("header reference count " + std::to_string(g.reference_count) +
            " but the objects have " + std::to_string(reference_sum));
  }
  if (shallow_sum != g.shallow_size) {
    problem("header shallow size " + std::to_string(g.shallow_size) +
            " but the objects' sizes add up to " + std::to_string(shallow_sum));
  }
  if (g.capacity < g.shallow_size) {
    problem("capacity " + std::to_string(g.capacity) + " below the shallow size " +
            std::to_string(g.shallow_size));
  }

  // Root and sentinel classes, and DevTools' default class filter.
  const uint64_t root_class = g.objects[0].class_id;
  for (uint64_t k = 1; k <= class_count; k++) {
    const Class &c = g.classes[k - 1];
    bool reserved_name = (c.name == "Root" || c.name == "Sentinel") && c.Library().empty();
    if (reserved_name && (k != root_class || instances[k] != 1)) {
      problem("class " + std::to_string(k) + " is named " + c.name +
              " with an empty library, which only the root's class may be");
    }
    if (k != root_class && instances[k] > 0 && c.Library().rfind("dart:", 0) != 0 &&
        c.Library().rfind("package:", 0) != 0) {
      problem("class " + std::to_string(k) + " (" + c.name + ") has library \"" + c.Library() +
              "\", which DevTools' default filter hides (not dart: or package:)");
    }
  }

  // External properties.
  uint64_t external_sum = 0;
  for (const ExternalProperty &p : g.external_properties) {
    external_sum += p.external_size;
    js_value("external property size", p.external_size);
    if (p.object == 0 || p.object > n) {
      problem("external property \"" + p.name + "\" of object " + std::to_string(p.object) +
              " not in 1.." + std::to_string(n));
    }
  }
  if (external_sum != g.external_size) {
    problem("header external size " + std::to_string(g.external_size) +
            " but the external properties add up to " + std::to_string(external_sum));
  }

  // Identity hash codes.
  if (g.has_identity_hashes) {
    std::unordered_set<uint64_t> per_class;
    per_class.reserve(n);
    for (uint64_t id = 1; id <= n; id++) {
      uint64_t h = g.identity_hashes[id - 1];
      if (h == 0) {
        problem(ObjectName(id) + ": identity hash code 0");
        continue;
      }
      js_value(ObjectName(id) + " identity hash code", h);
      uint64_t class_id = g.objects[id - 1].class_id;
      if (h >= kJsLimit || class_id > class_count) continue;
      if (!per_class.insert(class_id << 31 | h).second) {
        problem(ObjectName(id) + ": identity hash code " + std::to_string(h) +
                " not unique in class " + std::to_string(class_id));
      }
    }
  }

  // Reachability: DevTools hides what the root does not reach.
  std::vector<uint64_t> reached = Reachable(g);
  if (reached.size() != n) {
    std::vector<bool> seen(n + 1);
    for (uint64_t id : reached) seen[id] = true;
    size_t reported = 0;
    for (uint64_t id = 1; id <= n && reported < 5; id++) {
      if (!seen[id]) {
        problem(ObjectName(id) + " is not reachable from the root");
        reported++;
      }
    }
    problem(std::to_string(n - reached.size()) + " of " + std::to_string(n) +
            " objects are not reachable from the root");
  }
  return problems;
}

std::string CheckReport(const Graph &graph) {
  std::ostringstream out;
  for (const std::string &p : Check(graph)) out << p << "\n";
  return out.str();
}

}  // namespace dartheap
