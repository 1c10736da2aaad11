// A headless Chromium for the tests of what heapdump shows in a browser: it opens a local file,
// runs JavaScript in it, clicks and types as a user would, and takes screenshots.
//
// It speaks the Chrome DevTools Protocol through a pipe (--remote-debugging-pipe: the browser
// reads commands on its descriptor 3 and writes answers and events on its descriptor 4, each a
// JSON text ended by a NUL byte), so it needs no network port, no websocket and no library.
//
// Nothing here may hang a test: every wait has a deadline, after which the call fails with
// error() saying what it waited for. The browser, all its helper processes and its temporary
// directory are gone when the Browser is destroyed. (A test killed outright leaves the directory,
// /tmp/hd-browser-*, behind; its browser still dies with it.)
//
// The browser is Debian's /usr/lib/chromium/chromium (or /usr/bin/chromium); HD_TEST_CHROMIUM
// in the environment names another executable. One Browser is for one thread.
#ifndef HEAPDUMP_TESTS_COMMON_BROWSER_H
#define HEAPDUMP_TESTS_COMMON_BROWSER_H

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace hdtest {

class Browser {
 public:
  // The executable Launch would start; empty if there is none.
  static std::string Executable();

  // Starts Chromium with a page of width x height CSS pixels (and a device pixel ratio of 1, so
  // screenshots are that size too). nullptr, with *why saying why, if it is not installed or
  // does not start; *why then includes the end of its log.
  static std::unique_ptr<Browser> Launch(std::string *why, int width = 1400, int height = 1000);
  ~Browser();
  Browser(const Browser &) = delete;
  Browser &operator=(const Browser &) = delete;

  // Opens the file at the absolute path and waits for its load event.
  bool Open(const std::string &path, double timeout_s = 30);

  // The value of a JavaScript expression in the page as JSON.stringify writes it ("\"abc\"",
  // "12", "true", "{\"a\":1}"); a promise is awaited first. "undefined" for what JSON cannot
  // express (undefined, a function). nullopt if it throws (error() has the exception; the line
  // numbers in its stack are one more than the expression's own) or takes longer than timeout_s.
  std::optional<std::string> Eval(const std::string &expression, double timeout_s = 30);
  // Eval of an expression whose value must be a string, a number.
  std::optional<std::string> EvalString(const std::string &expression, double timeout_s = 30);
  std::optional<double> EvalNumber(const std::string &expression, double timeout_s = 30);

  // Evaluates the expression every 50 ms until it is truthy; false when timeout_s has passed
  // (error() then has its last value or exception). Exceptions do not stop the wait: an element
  // the expression looks at may not exist yet.
  bool WaitFor(const std::string &expression, double timeout_s = 30);

  // A left click with real mouse events (moved, pressed, released) at (x, y) in CSS pixels from
  // the top left of the viewport, the coordinates getBoundingClientRect() gives.
  bool Click(double x, double y);
  // Scrolls the first element matching the CSS selector into view and clicks its middle.
  bool ClickOn(const std::string &selector);
  // Types text into the focused element, as an input method would insert it.
  bool Type(const std::string &text);
  // Writes a PNG of the viewport to png_path.
  bool Screenshot(const std::string &png_path);

  // What the last failed call failed on.
  const std::string &error() const { return error_; }
  // What the page wrote to its console, and its uncaught exceptions, one a line.
  const std::string &Console() const { return console_; }
  // Chromium's own output (stdout and stderr), for a failing test to show.
  std::string Log() const;

 private:
  class Deadline;
  Browser() = default;

  bool Start(const std::string &executable, int width, int height);
  // Sends a command (to the page when session is set, else to the browser) and returns the
  // whole answer; the events read on the way are noted.
  std::optional<std::string> Command(const std::string &method, const std::string &params,
                                     const std::string &session, const Deadline &deadline);
  // Sets *exception to what the expression threw, if it did.
  std::optional<std::string> Evaluate(const std::string &expression, const Deadline &deadline,
                                      std::optional<std::string> *exception);
  bool Send(const std::string &message, const Deadline &deadline);
  std::optional<std::string> Receive(const Deadline &deadline);
  void Note(const std::string &event);
  std::string LogTail() const;
  void Stop();

  pid_t pid_ = -1;
  int to_browser_ = -1;    // our end of the browser's descriptor 3
  int from_browser_ = -1;  // our end of its descriptor 4
  std::string dir_;        // its profile, home and log; removed with it
  std::string received_;   // bytes read past the last whole message
  size_t searched_ = 0;    // how much of received_ has no NUL
  std::string session_;    // the page's session
  int next_id_ = 1;
  std::vector<std::string> loaded_;  // the loaderIds of the documents whose load event came
  bool started_ = false;             // it answered all of Start's commands
  bool crashed_ = false;
  std::string error_;
  std::string console_;
};

// The pieces of the protocol, exposed so they can be tested on their own.
namespace cdp {

// s as a JSON string literal, quotes included.
std::string JsonQuote(std::string_view s);
// The string at a path of object keys (and array indexes, in decimal) in a JSON text, with its
// escapes decoded to UTF-8; nullopt if there is none or it is not a string.
std::optional<std::string> JsonString(std::string_view json, const std::vector<std::string> &path);
// The text of the value at the path as it appears in json (a number's digits, an object's braces
// and all); nullopt if there is none.
std::optional<std::string> JsonRaw(std::string_view json, const std::vector<std::string> &path);
// The bytes that base64 text stands for; nullopt if it is not base64.
std::optional<std::string> Base64Decode(std::string_view text);
// A file:// URL for an absolute path.
std::string FileUrl(const std::string &path);

}  // namespace cdp

}  // namespace hdtest

#endif
