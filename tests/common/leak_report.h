// What the tests read of a leak check: heapdump's report and valgrind's memcheck summary.
#ifndef HEAPDUMP_TESTS_COMMON_LEAK_REPORT_H
#define HEAPDUMP_TESTS_COMMON_LEAK_REPORT_H

#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace hdtest {

// (bytes, blocks).
using Amount = std::pair<uint64_t, uint64_t>;

// The leak check's groups in a text report: (category title, site) -> amount, e.g.
// {"DEFINITELY LOST", "lose_block"} -> {2000, 1}.
using LeakGroups = std::map<std::pair<std::string, std::string>, Amount>;
LeakGroups ParseLeakGroups(const std::string &report);

// The sum of a site's groups in the two lost categories.
Amount LostAt(const LeakGroups &groups, const std::string &site);

// valgrind's summary: "definitely lost", "indirectly lost", "possibly lost", "still reachable"
// -> amount.
std::map<std::string, Amount> ParseMemcheckSummary(const std::string &valgrind_output);

}  // namespace hdtest

#endif
