// The pieces of the DevTools protocol the browser driver (browser.h) reads and writes, on their
// own: what a wrong answer there would do is make a browser test pass or fail for the wrong
// reason.
#include <gtest/gtest.h>

#include "browser.h"

namespace hdtest::cdp {
namespace {

TEST(BrowserProtocol, StringsRoundTripThroughJson) {
  const std::string tricky = "a\"b\\c\n\t\x01</script> \xc3\xa9 \xf0\x9f\x98\x80";
  const std::string json = "{\"result\":{\"value\":" + JsonQuote(tricky) + "}}";
  EXPECT_EQ(JsonString(json, {"result", "value"}), tricky);
  // Chromium writes every non-ASCII character as \u escapes, astral ones as surrogate pairs.
  EXPECT_EQ(JsonString(R"({"v":"\u00e9\ud83d\ude00\/"})", {"v"}), "\xc3\xa9\xf0\x9f\x98\x80/");
  EXPECT_EQ(JsonString(R"({"a":[1,{"b":"x"}]})", {"a", "1", "b"}), "x");
  EXPECT_EQ(JsonString(R"({"v":12})", {"v"}), std::nullopt) << "not a string";
  EXPECT_EQ(JsonString(R"({"v":"x"})", {"w"}), std::nullopt);
  EXPECT_EQ(JsonRaw(R"({"id":7,"result":{"a":[1, 2]}})", {"result"}), R"({"a":[1, 2]})");
  EXPECT_EQ(JsonRaw(R"({"id":7})", {"id"}), "7");
  // A key inside a string value is not a key.
  EXPECT_EQ(JsonRaw(R"({"s":"\"id\":9","id":3})", {"id"}), "3");
}

TEST(BrowserProtocol, Base64AndFileUrls) {
  EXPECT_EQ(Base64Decode("iVBORw0KGgo="), std::string("\x89PNG\r\n\x1a\n", 8));
  EXPECT_EQ(Base64Decode(""), "");
  EXPECT_EQ(Base64Decode("a!=="), std::nullopt);
  EXPECT_EQ(FileUrl("/tmp/a b/#1%.html"), "file:///tmp/a%20b/%231%25.html");
}

}  // namespace
}  // namespace hdtest::cdp
