#include "leak_report.h"

#include <algorithm>
#include <regex>

#include "process.h"

namespace hdtest {

LeakGroups ParseLeakGroups(const std::string &report) {
  LeakGroups groups;
  std::string category;
  static const std::regex kRow(R"(^ +([0-9]+) +([0-9]+)(?: +[0-9.]+s)?  (.+)$)");
  for (const std::string &line : Lines(report)) {
    if (line == "DEFINITELY LOST" || line == "INDIRECTLY LOST" || line == "POSSIBLY LOST" ||
        line == "STILL REACHABLE") {
      category = line;
      continue;
    }
    std::smatch m;
    if (!category.empty() && std::regex_match(line, m, kRow)) {
      Amount &g = groups[{category, m[3].str()}];
      g.first += std::stoull(m[1].str());
      g.second += std::stoull(m[2].str());
    }
  }
  return groups;
}

Amount LostAt(const LeakGroups &groups, const std::string &site) {
  Amount lost{0, 0};
  for (const char *category : {"DEFINITELY LOST", "INDIRECTLY LOST"}) {
    auto it = groups.find({category, site});
    if (it == groups.end()) continue;
    lost.first += it->second.first;
    lost.second += it->second.second;
  }
  return lost;
}

std::map<std::string, Amount> ParseMemcheckSummary(const std::string &out) {
  std::map<std::string, Amount> summary;
  static const std::regex kLine(
      R"(==[0-9]+== +(definitely lost|indirectly lost|possibly lost|still reachable): )"
      R"(([0-9,]+) bytes in ([0-9,]+) blocks)");
  auto number = [](std::string s) {
    s.erase(std::remove(s.begin(), s.end(), ','), s.end());
    return std::stoull(s);
  };
  for (const std::string &line : Lines(out)) {
    std::smatch m;
    if (std::regex_search(line, m, kLine)) summary[m[1].str()] = {number(m[2]), number(m[3])};
  }
  return summary;
}

}  // namespace hdtest
