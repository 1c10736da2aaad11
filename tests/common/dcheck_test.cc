// HD_DCHECK (heapdump/contract/dcheck.h): a broken check stops a build with debug checks and
// says where, and costs nothing, its condition not even evaluated, in the others. The sanitizer
// builds, whose tests CI runs, are builds with debug checks.
#include <gtest/gtest.h>

#include "heapdump/contract/dcheck.h"

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

TEST(DcheckTest, SanitizerBuildsCheck) {
  if (kSanitized) {
    EXPECT_TRUE(HD_DEBUG);
  }
}

TEST(DcheckTest, ABrokenCheckStopsTheProcessWhereChecksAreOn) {
  int evaluated = 0;
  auto check = [&evaluated] { HD_DCHECK(++evaluated < 0); };
  if (HD_DEBUG) {
    EXPECT_DEATH(check(),
                 "heapdump: debug check failed at .*dcheck_test.cc:[0-9]+: "
                 "\\+\\+evaluated < 0");
  } else {
    check();
    EXPECT_EQ(evaluated, 0) << "the condition of a dropped check ran";
  }
  HD_DCHECK(evaluated >= 0);  // one that holds passes either way
}

}  // namespace
