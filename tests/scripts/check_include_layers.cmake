# The include layering (#30): a file of layer L includes headers only of L and of the layers L links
# (src/CMakeLists.txt). The link order alone misses a header-only call up the layers (a virtual or
# inline one links fine: the pool once included runtime/ and linked). Run by ctest as
#   cmake -DZT_ROOT=<tree> -DZT_LAYER_TABLE=<file> -P check_include_layers.cmake
# The table file (tests/CMakeLists.txt writes it from the link graph) sets ZT_LAYERS (core memory
# ...) and ZT_LAYER_<name>: the layers <name> links, directly or not. A layer's folder is
# <tree>/src/<name> or <tree>/<name>; a layer without one (zt_mpi, in comm/) is skipped.
cmake_minimum_required(VERSION 3.25)

if(NOT ZT_ROOT OR NOT ZT_LAYER_TABLE)
  message(FATAL_ERROR "usage: cmake -DZT_ROOT=<tree> -DZT_LAYER_TABLE=<file> -P check_include_layers.cmake")
endif()
include(${ZT_LAYER_TABLE})

set(violations "")
set(scanned 0)
foreach(layer IN LISTS ZT_LAYERS)
  if(IS_DIRECTORY ${ZT_ROOT}/src/${layer})
    set(dir ${ZT_ROOT}/src/${layer})
  elseif(IS_DIRECTORY ${ZT_ROOT}/${layer})
    set(dir ${ZT_ROOT}/${layer})
  else()
    continue()
  endif()
  set(allowed ${layer} ${ZT_LAYER_${layer}})
  list(JOIN allowed ", " allowed_text)
  file(GLOB_RECURSE files RELATIVE ${ZT_ROOT} ${dir}/*.h ${dir}/*.cc ${dir}/*.cu ${dir}/*.cuh)
  list(SORT files)
  foreach(f IN LISTS files)
    math(EXPR scanned "${scanned} + 1")
    file(STRINGS ${ZT_ROOT}/${f} lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"[a-z_]+/")
    foreach(line IN LISTS lines)
      string(REGEX MATCH "\"([a-z_]+)/[^\"]*\"" header "${line}")
      set(prefix ${CMAKE_MATCH_1})
      # Only the layers' own folders count; anything else (a library's "cub/...") is not ours.
      if(prefix IN_LIST ZT_LAYERS AND NOT prefix IN_LIST allowed)
        list(APPEND violations "${f}: includes ${header}, but ${layer} is below ${prefix} (it may include ${allowed_text})")
      endif()
    endforeach()
  endforeach()
endforeach()

if(scanned EQUAL 0)
  message(FATAL_ERROR "no sources of the layers (${ZT_LAYERS}) under ${ZT_ROOT}")
endif()
list(LENGTH violations n)
if(n GREATER 0)
  foreach(v IN LISTS violations)
    message("${v}")
  endforeach()
  message(FATAL_ERROR "${n} include(s) up the layers. A lower layer must not see a higher one (README "
                      "\"Architecture\"): move what it needs down, or give it an interface of its own that the "
                      "higher layer implements.")
endif()
message(STATUS "include layering: ${scanned} files of ${ZT_LAYERS}: no include up the layers")
