# Helpers shared by the component CMakeLists.
include(GoogleTest)

# hd_add_gtest(NAME LABEL unit|integration [SLOW filter] [ROOT filter] [DETACHED_COLLECTOR]
#              SOURCES src... [LIBS lib...]): a GoogleTest executable registered with ctest.
# Every test gets the ctest label LABEL (unit: code in this process only; integration: real
# processes, sockets or files); tests matching the gtest filter SLOW (over ~5 s) also get `slow`,
# those matching ROOT (they need root, and report SKIPPED without it) also get `root`, so
# `ctest -L unit` or `ctest -LE slow` run a part. DETACHED_COLLECTOR registers its tests a
# second time, as "detached.SUITE.TEST", with the collector daemons of tests/common started the
# way users start them (detached, found by their pid file) instead of with --foreground.
function(hd_add_gtest name)
  cmake_parse_arguments(ARG "DETACHED_COLLECTOR" "LABEL;SLOW;ROOT" "SOURCES;LIBS" ${ARGN})
  if(NOT ARG_LABEL MATCHES "^(unit|integration)$")
    message(FATAL_ERROR "hd_add_gtest(${name}): LABEL unit or integration")
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest GTest::gtest_main)
  # The parts, each a gtest filter with its labels: the SLOW tests, the ROOT tests, the rest.
  set(special "")
  set(parts "")
  foreach(part SLOW ROOT)
    if(ARG_${part})
      list(APPEND special "${ARG_${part}}")
      list(APPEND parts ${part})
    endif()
  endforeach()
  list(JOIN special ":" special)
  list(APPEND parts REST)
  set(modes plain)
  if(ARG_DETACHED_COLLECTOR)
    list(APPEND modes detached)
  endif()
  # Every property value must be a single string: the discovered tests' file writes a list's
  # items as separate arguments, which would make an environment entry or a label a property
  # name. So the mode is one ENVIRONMENT_MODIFICATION, and the labels (a list) are set by a
  # script that ctest includes after the discovered tests.
  set(label_script "${CMAKE_CURRENT_BINARY_DIR}/${name}_labels.cmake")
  set(label_commands "")
  foreach(mode ${modes})
    set(extra_properties "")
    set(prefix "")
    if(mode STREQUAL "detached")
      set(extra_properties ENVIRONMENT_MODIFICATION "HD_TEST_COLLECTOR_MODE=set:detached")
      set(prefix "detached.")
    endif()
    foreach(part ${parts})
      if(part STREQUAL "REST")
        set(filter "*")
        if(special)
          set(filter "-${special}")
        endif()
        set(labels ${ARG_LABEL})
      else()
        set(filter "${ARG_${part}}")
        string(TOLOWER ${part} extra)
        set(labels "${ARG_LABEL};${extra}")
      endif()
      set(list_name "${name}_${mode}_${part}_TESTS")
      gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 TEST_PREFIX "${prefix}" TEST_FILTER "${filter}"
        TEST_LIST ${list_name}
        PROPERTIES ENVIRONMENT "HEAPDUMP_BUILD_DIR=${CMAKE_BINARY_DIR}" ${extra_properties})
      string(APPEND label_commands "foreach(t IN LISTS ${list_name})\n"
        "  set_tests_properties(\"\${t}\" PROPERTIES LABELS \"${labels}\")\nendforeach()\n")
    endforeach()
  endforeach()
  file(WRITE "${label_script}" "${label_commands}")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${label_script}")
endfunction()
