# What paratrain's optional components take from the system, found the same way for
# the installed CMake package (paratrainConfig.cmake) and for the Conan package
# (paratrainConanSystemDeps.cmake). The core's own dependencies, LibTorch and range-v3,
# are plain find_dependency() calls in those two files.
#
# paratrain_find_component_dependencies(<component> <reason-var>)
#   Looks for what <component> (mpi, nccl, gloo or hdf5) needs. Sets <reason-var> to "" when all of
#   it was found, else to a sentence naming what is missing and how to point CMake at it.
#   Quiet when the caller's find_package(paratrain ...) was QUIET; never REQUIRED, so
#   that an optional component that is missing leaves paratrain itself found.
#
#   A macro, not a function: find modules leave their imported targets and result
#   variables in the caller's scope, as find_package itself does.
#
#   nccl also defines paratrain::libnccl, an IMPORTED target for the NCCL library found
#   here, and gloo paratrain::libgloo for Gloo's headers: the installed paratrain::nccl
#   and paratrain::gloo link them by those names, so the package holds no absolute path
#   of the machine it was built on. hdf5 needs no such target: FindHDF5 makes
#   hdf5::hdf5_cpp and HDF5::HDF5 here as it did in paratrain's own build.
macro(paratrain_find_component_dependencies _paratrain_component _paratrain_reason)
  set(${_paratrain_reason} "")
  set(_paratrain_quiet "")
  if(paratrain_FIND_QUIETLY)
    set(_paratrain_quiet QUIET)
  endif()

  if("${_paratrain_component}" STREQUAL "mpi")
    if(NOT DEFINED MPI_CXX_SKIP_MPICXX)
      set(MPI_CXX_SKIP_MPICXX ON)  # the C API only; OpenMPI's C++ bindings are deprecated
    endif()
    if(NOT TARGET MPI::MPI_CXX)
      find_package(MPI ${_paratrain_quiet} COMPONENTS CXX)
    endif()
    if(NOT TARGET Boost::mpi)
      find_package(Boost 1.74 ${_paratrain_quiet} CONFIG COMPONENTS mpi)
    endif()
    if(NOT TARGET MPI::MPI_CXX OR NOT TARGET Boost::mpi)
      string(CONCAT ${_paratrain_reason}
          "paratrain::mpi needs MPI (C++) and Boost.MPI >= 1.74, and one of them was not found "
          "(Debian: apt-get install libopenmpi-dev libboost-mpi-dev; else set MPI_HOME and Boost_DIR)")
    endif()

  elseif("${_paratrain_component}" STREQUAL "nccl")
    if(NOT DEFINED CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT} AND EXISTS /usr/local/cuda)
      set(CUDAToolkit_ROOT /usr/local/cuda)
    endif()
    if(NOT TARGET CUDA::cudart)
      find_package(CUDAToolkit ${_paratrain_quiet})
    endif()
    find_path(PARATRAIN_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_ROOT}/include)
    find_library(PARATRAIN_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ${CUDAToolkit_ROOT}/lib)
    if(TARGET CUDA::cudart AND PARATRAIN_NCCL_INCLUDE_DIR AND PARATRAIN_NCCL_LIBRARY)
      if(NOT TARGET paratrain::libnccl)
        add_library(paratrain::libnccl UNKNOWN IMPORTED)
        set_target_properties(paratrain::libnccl PROPERTIES
          IMPORTED_LOCATION "${PARATRAIN_NCCL_LIBRARY}"
          INTERFACE_INCLUDE_DIRECTORIES "${PARATRAIN_NCCL_INCLUDE_DIR}")
      endif()
    else()
      string(CONCAT ${_paratrain_reason}
          "paratrain::nccl needs the CUDA toolkit and NCCL, and one of them was not found "
          "(set CUDAToolkit_ROOT, or PARATRAIN_NCCL_INCLUDE_DIR and PARATRAIN_NCCL_LIBRARY)")
    endif()

  elseif("${_paratrain_component}" STREQUAL "gloo")
    # c10d's ProcessGroupGloo is in libtorch_cpu, which links libgloo itself: what is
    # needed is a LibTorch built with it and Gloo's headers (libgloo-dev on Debian).
    set(_paratrain_torch_definitions "")
    if(TARGET torch_cpu)
      get_target_property(_paratrain_torch_definitions torch_cpu INTERFACE_COMPILE_DEFINITIONS)
    endif()
    find_path(PARATRAIN_GLOO_INCLUDE_DIR gloo/context.h)
    if("USE_C10D_GLOO" IN_LIST _paratrain_torch_definitions AND PARATRAIN_GLOO_INCLUDE_DIR)
      if(NOT TARGET paratrain::libgloo)
        add_library(paratrain::libgloo INTERFACE IMPORTED)
        set_target_properties(paratrain::libgloo PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${PARATRAIN_GLOO_INCLUDE_DIR}")
      endif()
    else()
      string(CONCAT ${_paratrain_reason}
          "paratrain::gloo needs a LibTorch built with c10d's Gloo backend (torch_cpu defines USE_C10D_GLOO) "
          "and Gloo's headers (Debian: apt-get install libgloo-dev; else set PARATRAIN_GLOO_INCLUDE_DIR)")
    endif()
    unset(_paratrain_torch_definitions)

  elseif("${_paratrain_component}" STREQUAL "hdf5")
    # HDF5's C++ API and its C library. The CXX component only: C would need the
    # consumer's project to enable C, and CXX brings the C library too (HDF5::HDF5).
    if(NOT TARGET hdf5::hdf5_cpp OR NOT TARGET HDF5::HDF5)
      find_package(HDF5 ${_paratrain_quiet} COMPONENTS CXX)
    endif()
    if(NOT TARGET hdf5::hdf5_cpp OR NOT TARGET HDF5::HDF5)
      string(CONCAT ${_paratrain_reason}
          "paratrain::hdf5 needs HDF5 with its C++ API (H5Cpp.h, libhdf5_cpp), which was not found "
          "(Debian: apt-get install libhdf5-dev; else set HDF5_ROOT)")
    endif()

  else()
    set(${_paratrain_reason}
        "paratrain has no component '${_paratrain_component}' (its components: mpi, nccl, gloo, hdf5)")
  endif()
  unset(_paratrain_quiet)
endmacro()
