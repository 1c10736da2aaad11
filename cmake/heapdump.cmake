# Helpers shared by the component CMakeLists.
include(GoogleTest)

# hd_add_gtest(NAME [DETACHED_COLLECTOR] SOURCES src... [LIBS lib...]): a GoogleTest executable
# registered with ctest. DETACHED_COLLECTOR registers its tests a second time, as
# "detached.SUITE.TEST", with the collector daemons of tests/common started the way users start
# them (detached, found by their pid file) instead of with --foreground.
function(hd_add_gtest name)
  cmake_parse_arguments(ARG "DETACHED_COLLECTOR" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main)
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60
    PROPERTIES ENVIRONMENT "HEAPDUMP_BUILD_DIR=${CMAKE_BINARY_DIR}")
  if(ARG_DETACHED_COLLECTOR)
    gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 TEST_PREFIX "detached."
      PROPERTIES ENVIRONMENT "HEAPDUMP_BUILD_DIR=${CMAKE_BINARY_DIR};HD_TEST_COLLECTOR_MODE=detached")
  endif()
endfunction()
