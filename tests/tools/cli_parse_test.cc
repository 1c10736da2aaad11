// The heapdump command line as parsed, without running anything: every command line the README
// and docs/tools.md show parses, every option is documented, and each command's help lists
// exactly the options it takes.
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

extern "C" {
#include "cli.h"
}

namespace {

std::string ReadFile(const std::string &path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The words of a shell command: quotes and backslashes as sh reads them, up to an unquoted
// comment, redirection or pipe.
std::vector<std::string> ShellWords(const std::string &line) {
  std::vector<std::string> words;
  std::string word;
  bool in_word = false;
  for (size_t i = 0; i < line.size(); i++) {
    char c = line[i];
    if (c == ' ' || c == '\t') {
      if (in_word) words.push_back(word);
      word.clear();
      in_word = false;
    } else if (!in_word && (c == '#' || c == '>' || c == '<' || c == '|' || c == ';' || c == '&')) {
      break;  // a comment, or what the shell does with the command's output
    } else if (c == '\'') {
      size_t end = line.find('\'', i + 1);
      word += line.substr(i + 1, end - i - 1);
      i = end;
      in_word = true;
    } else if (c == '"') {
      for (i++; i < line.size() && line[i] != '"'; i++) {
        if (line[i] == '\\' && i + 1 < line.size()) i++;
        word += line[i];
      }
      in_word = true;
    } else if (c == '\\' && i + 1 < line.size()) {
      word += line[++i];
      in_word = true;
    } else {
      word += c;
      in_word = true;
    }
  }
  if (in_word) words.push_back(word);
  return words;
}

bool IsCommand(const std::string &name) {
  for (unsigned i = 0; i < CLI_COMMAND_COUNT; i++) {
    if (name == cli_command_at(i)->name) return true;
  }
  return false;
}

// The `heapdump COMMAND ...` lines of a Markdown file's code blocks (code spans in prose name
// commands and options, as in `heapdump report --json`; they are not command lines).
std::vector<std::string> DocCommandLines(const std::string &path) {
  std::vector<std::string> found;
  std::istringstream in(ReadFile(path));
  const std::regex code_line(R"(^ {4,}(heapdump \S.*)$)");
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (!std::regex_match(line, m, code_line)) continue;
    std::vector<std::string> words = ShellWords(m[1]);
    if (words.size() >= 2 && IsCommand(words[1])) found.push_back(m[1]);
  }
  return found;
}

// What a function printed on one of our descriptors (1 or 2) while it ran.
class Capture {
 public:
  explicit Capture(int fd) : fd_(fd) {
    fflush(nullptr);
    file_ = tmpfile();
    saved_ = dup(fd_);
    dup2(fileno(file_), fd_);
  }
  std::string Take() {
    fflush(nullptr);
    dup2(saved_, fd_);
    close(saved_);
    std::string text;
    rewind(file_);
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, file_)) > 0) text.append(buf, n);
    fclose(file_);
    return text;
  }

 private:
  int fd_;
  int saved_;
  FILE *file_;
};

struct Parsed {
  int rc;
  const cli_command *command;
  std::vector<std::string> args;
  std::string err;
};

Parsed Parse(std::vector<std::string> words) {
  std::vector<char *> argv;
  for (std::string &w : words) argv.push_back(w.data());
  argv.push_back(nullptr);
  cli_options o;
  cli_invocation inv = {};
  Capture err(2);
  Parsed p;
  p.rc = cli_parse(static_cast<int>(words.size()), argv.data(), &o, &inv);
  p.err = err.Take();
  p.command = inv.command;
  for (int i = 0; i < inv.argc; i++) p.args.push_back(inv.argv[i]);
  return p;
}

TEST(CliParseTest, EveryCommandLineOfTheDocsParses) {
  size_t seen = 0;
  std::set<std::string> commands;
  for (const char *doc : {"README.md", "docs/tools.md"}) {
    for (const std::string &line : DocCommandLines(std::string(HD_SOURCE_DIR) + "/" + doc)) {
      std::vector<std::string> words = ShellWords(line);
      Parsed p = Parse(words);
      EXPECT_EQ(p.rc, CLI_GO_ON) << doc << ": " << line << "\n" << p.err;
      if (p.rc != CLI_GO_ON) continue;
      EXPECT_EQ(p.command->name, words[1]) << line;
      commands.insert(words[1]);
      seen++;
    }
  }
  // The docs show each command at work (delete, download and list in the README's lines).
  for (unsigned i = 0; i < CLI_COMMAND_COUNT; i++) {
    EXPECT_EQ(commands.count(cli_command_at(i)->name), 1u) << cli_command_at(i)->name;
  }
  EXPECT_GE(seen, 25u);
}

TEST(CliParseTest, ArgumentsReachTheCommandAsWritten) {
  Parsed run = Parse({"heapdump", "run", "-o", "x.pb.gz", "--", "./prog", "-o", "--its-own"});
  ASSERT_EQ(run.rc, CLI_GO_ON) << run.err;
  EXPECT_EQ(run.args, (std::vector<std::string>{"./prog", "-o", "--its-own"}));
  // run's options end at COMMAND even without "--".
  Parsed bare = Parse({"heapdump", "run", "--contents", "./prog", "--json"});
  ASSERT_EQ(bare.rc, CLI_GO_ON) << bare.err;
  EXPECT_EQ(bare.args, (std::vector<std::string>{"./prog", "--json"}));
  // The others take options after their arguments too.
  Parsed diff = Parse({"heapdump", "diff", "a.heapdump", "--by", "stack", "b.heapdump"});
  ASSERT_EQ(diff.rc, CLI_GO_ON) << diff.err;
  EXPECT_EQ(diff.args, (std::vector<std::string>{"a.heapdump", "b.heapdump"}));
  // Parsing twice in one process starts afresh.
  Parsed again = Parse({"heapdump", "run", "./prog", "--json"});
  EXPECT_EQ(again.args, (std::vector<std::string>{"./prog", "--json"}));
}

TEST(CliParseTest, ArgumentCountsAreChecked) {
  struct {
    std::vector<std::string> words;
    const char *message;
  } cases[] = {
      {{"heapdump", "list", "extra"}, "list: unexpected argument 'extra'"},
      {{"heapdump", "leaks", "x"}, "leaks: unexpected argument 'x'"},
      {{"heapdump", "download"}, "download: wants exactly one snapshot ID"},
      {{"heapdump", "report", "a", "b"}, "report: wants exactly one INPUT file"},
      {{"heapdump", "diff", "a"}, "diff: wants two snapshot files, BASE and NEW"},
      {{"heapdump", "frobnicate"}, "unknown command 'frobnicate'"},
      {{"heapdump", "report", "a", "--frob"}, "report: option --frob is unknown"},
      {{"heapdump", "snapshot", "-z"}, "snapshot: option -z is unknown"},
      {{"heapdump", "snapshot", "--pid"}, "snapshot: option --pid is unknown or needs a value"},
      // The "--" that ends the options is no value (it named the page "--").
      {{"heapdump", "run", "--html", "--", "true"}, "run: option --html needs a value before --"},
      {{"heapdump", "run", "--output", "--", "true"},
       "run: option --output needs a value before --"},
      {{"heapdump", "run", "-o", "--", "true"}, "run: option --output needs a value before --"},
  };
  for (const auto &c : cases) {
    Parsed p = Parse(c.words);
    EXPECT_EQ(p.rc, EXIT_USAGE) << c.message;
    EXPECT_NE(p.err.find(c.message), std::string::npos) << p.err;
  }
}

// The help of each command lists exactly the options it takes: each option is either in the
// help and accepted, or absent and refused as one the command "does not take".
TEST(CliParseTest, EachCommandsHelpListsTheOptionsItTakes) {
  for (unsigned id = 0; id < CLI_COMMAND_COUNT; id++) {
    const std::string command = cli_command_at(id)->name;
    Capture out(1);
    cli_command_help(id);
    const std::string help = out.Take();
    EXPECT_EQ(help.rfind("usage: heapdump " + command, 0), 0u) << help;
    size_t listed = 0;
    for (size_t i = 0; cli_option_name(i) != nullptr; i++) {
      const std::string option = std::string("--") + cli_option_name(i);
      if (option == "--help" || option == "--version") continue;  // they print and end
      const bool in_help =
          std::regex_search(help, std::regex("\n {2,6}(-., )?" + option + "(?![-a-z])"));
      // A value the option may refuse, but not as an option the command does not take.
      Parsed p = Parse({"heapdump", command, option + "=1"});
      Parsed s = Parse({"heapdump", command, option});
      const bool refused = p.err.find("does not take " + option + " ") != std::string::npos ||
                           s.err.find("does not take " + option + " ") != std::string::npos;
      EXPECT_NE(in_help, refused) << command << " " << option << ":\n" << p.err << s.err;
      listed += in_help;
    }
    EXPECT_GT(listed, 0u) << command;
    std::istringstream lines(help);
    for (std::string line; std::getline(lines, line);) {
      EXPECT_LE(line.size(), 100u) << command << ": " << line;
    }
  }
}

// An option users cannot find in docs/tools.md is an option they do not have.
TEST(CliParseTest, EveryOptionIsDocumented) {
  const std::string doc = ReadFile(std::string(HD_SOURCE_DIR) + "/docs/tools.md");
  size_t count = 0;
  for (size_t i = 0; cli_option_name(i) != nullptr; i++, count++) {
    const std::string option = std::string("--") + cli_option_name(i);
    EXPECT_TRUE(std::regex_search(doc, std::regex(option + "(?![-a-z])"))) << option;
  }
  EXPECT_GT(count, 20u);
}

}  // namespace
