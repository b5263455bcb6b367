# Included by the paratrain-config.cmake that Conan's CMakeDeps generates (conanfile.py
# lists this file in cmake_build_modules); not part of the `cmake --install` package.
#
# Conan provides paratrain's headers and range-v3, and CMakeDeps has already made the
# targets paratrain::paratrain, paratrain::mpi, paratrain::nccl, paratrain::gloo and
# paratrain::hdf5 (and paratrain::all, all of them). LibTorch, MPI/Boost.MPI, CUDA/NCCL,
# Gloo and HDF5 come from the system (ConanCenter's libtorch has no c10d, and there is no NCCL recipe), and
# are attached here, found exactly as paratrainConfig.cmake finds them:
#   - LibTorch always (find_package(paratrain) fails without it);
#   - a component's dependencies only when find_package(paratrain COMPONENTS ...) asks
#     for that component. Linking a component that was not asked for stops CMake with
#     an error naming the missing COMPONENTS argument.
# paratrain_<component>_FOUND is set as the installed package sets it.

include(CMakeFindDependencyMacro)
include("${CMAKE_CURRENT_LIST_DIR}/paratrainDependencies.cmake")

find_dependency(Torch)  # no version: Debian's config reports 1.13.0 for 1.13.1

# find_package may run again (another directory, another list of components): attach
# each target's dependencies once, and replace a component's "not asked for" marker
# when a later call asks for it.
function(_paratrain_conan_attach target)
  get_target_property(attached ${target} PARATRAIN_CONAN_ATTACHED)
  if(NOT attached)
    get_target_property(links ${target} INTERFACE_LINK_LIBRARIES)
    if(NOT links)
      set(links "")
    endif()
    list(FILTER links EXCLUDE REGEX "_needs_find_package_COMPONENTS_")
    list(APPEND links ${ARGN})
    set_target_properties(${target} PROPERTIES INTERFACE_LINK_LIBRARIES "${links}" PARATRAIN_CONAN_ATTACHED TRUE)
  endif()
endfunction()

# A component that was not asked for links a target that does not exist, so CMake stops
# with: Target "app" links to target "paratrain::mpi_needs_find_package_COMPONENTS_mpi"
# but the target was not found.
function(_paratrain_conan_mark_unrequested component)
  set(target paratrain::${component})
  set(marker paratrain::${component}_needs_find_package_COMPONENTS_${component})
  get_target_property(attached ${target} PARATRAIN_CONAN_ATTACHED)
  get_target_property(links ${target} INTERFACE_LINK_LIBRARIES)
  if(NOT attached AND NOT marker IN_LIST links)
    set_property(TARGET ${target} APPEND PROPERTY INTERFACE_LINK_LIBRARIES ${marker})
  endif()
endfunction()

_paratrain_conan_attach(paratrain::paratrain torch)
# The headers are C++20 (concepts, defaulted comparisons): say so on the target, as the
# source tree's and the installed paratrain::paratrain do, whatever the consumer's
# toolchain sets (CMakeDeps carries no compile features).
get_target_property(_paratrain_features paratrain::paratrain INTERFACE_COMPILE_FEATURES)
if(NOT "cxx_std_20" IN_LIST _paratrain_features)
  set_property(TARGET paratrain::paratrain APPEND PROPERTY INTERFACE_COMPILE_FEATURES cxx_std_20)
endif()
unset(_paratrain_features)
set(paratrain_paratrain_FOUND TRUE)

set(_paratrain_components ${paratrain_FIND_COMPONENTS})  # nccl needs no mpi: Note [NCCL bootstrap]
set(_paratrain_system_mpi Boost::mpi MPI::MPI_CXX)
set(_paratrain_system_nccl CUDA::cudart paratrain::libnccl)
set(_paratrain_system_gloo paratrain::libgloo)
set(_paratrain_system_hdf5 hdf5::hdf5_cpp HDF5::HDF5)
set(_paratrain_missing "")

foreach(_paratrain_component IN ITEMS mpi nccl gloo hdf5)
  if(NOT _paratrain_component IN_LIST _paratrain_components)
    if(TARGET paratrain::${_paratrain_component})
      _paratrain_conan_mark_unrequested(${_paratrain_component})
    endif()
    continue()
  endif()

  if(NOT TARGET paratrain::${_paratrain_component})
    set(_paratrain_reason "this Conan package of paratrain declares no component ${_paratrain_component}")
  else()
    paratrain_find_component_dependencies(${_paratrain_component} _paratrain_reason)
  endif()
  if(_paratrain_reason STREQUAL "")
    _paratrain_conan_attach(paratrain::${_paratrain_component} ${_paratrain_system_${_paratrain_component}})
    set(paratrain_${_paratrain_component}_FOUND TRUE)
  else()
    set(paratrain_${_paratrain_component}_FOUND FALSE)
    if(paratrain_FIND_REQUIRED_${_paratrain_component})
      string(APPEND _paratrain_missing "\n  ${_paratrain_reason}")
    elseif(NOT paratrain_FIND_QUIETLY)
      message(STATUS "paratrain: optional component ${_paratrain_component} not found: ${_paratrain_reason}")
    endif()
  endif()
endforeach()

list(REMOVE_ITEM _paratrain_components mpi nccl gloo hdf5 paratrain)
foreach(_paratrain_component IN LISTS _paratrain_components)
  set(paratrain_${_paratrain_component}_FOUND FALSE)
  set(_paratrain_reason
      "paratrain has no component '${_paratrain_component}' (its components: mpi, nccl, gloo, hdf5)")
  if(paratrain_FIND_REQUIRED_${_paratrain_component})
    string(APPEND _paratrain_missing "\n  ${_paratrain_reason}")
  endif()
endforeach()

if(NOT _paratrain_missing STREQUAL "")
  set(paratrain_FOUND FALSE)
  set(paratrain_NOT_FOUND_MESSAGE "a required component is missing:${_paratrain_missing}")
endif()

unset(_paratrain_components)
unset(_paratrain_component)
unset(_paratrain_missing)
unset(_paratrain_reason)
unset(_paratrain_system_mpi)
unset(_paratrain_system_nccl)
unset(_paratrain_system_gloo)
unset(_paratrain_system_hdf5)
