# Builds TARGET in BUILD_DIR and passes when the build fails with every `// expect: REGEX` of
# SOURCE in its output (one regular expression per line). Run by ctest (tests/CMakeLists.txt):
#   cmake -DBUILD_DIR=... -DTARGET=... -DSOURCE=... -P expect_compile_errors.cmake
execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET} RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(rc EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled; every case in ${SOURCE} must fail to compile")
endif()
file(STRINGS ${SOURCE} expectations REGEX "// expect: ")
set(missing "")
foreach(line IN LISTS expectations)
  string(REGEX REPLACE "^.*// expect: " "" regex "${line}")
  if(NOT out MATCHES "${regex}")
    string(APPEND missing "\n  ${regex}")
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "${TARGET}: the compiler's output lacks:${missing}\n--- output ---\n${out}")
endif()
list(LENGTH expectations n)
message(STATUS "${TARGET}: failed to compile with each of the ${n} expected messages")
