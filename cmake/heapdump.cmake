# Helpers shared by the component CMakeLists.
include(GoogleTest)

# hd_add_gtest(NAME SOURCES src... [LIBS lib...]): a GoogleTest executable registered with ctest.
function(hd_add_gtest name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main)
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60
    PROPERTIES ENVIRONMENT "HEAPDUMP_BUILD_DIR=${CMAKE_BINARY_DIR}")
endfunction()
