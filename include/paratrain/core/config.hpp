#pragma once
/// \file
/// The only place paratrain defines or reads feature macros.
///
/// The component targets set these: `paratrain::mpi` defines PARATRAIN_HAS_MPI=1,
/// `paratrain::nccl` defines PARATRAIN_HAS_NCCL=1, `paratrain::gloo` defines
/// PARATRAIN_HAS_GLOO=1, `paratrain::hdf5` defines PARATRAIN_HAS_HDF5=1. Without them the
/// umbrella header paratrain.hpp leaves those communicators and data::Hdf5Dataset out, so
/// a project that links only `paratrain::paratrain` never needs MPI, CUDA, Gloo or HDF5
/// headers.

#ifndef PARATRAIN_HAS_MPI
#define PARATRAIN_HAS_MPI 0
#endif

#ifndef PARATRAIN_HAS_NCCL
#define PARATRAIN_HAS_NCCL 0
#endif

#ifndef PARATRAIN_HAS_GLOO
#define PARATRAIN_HAS_GLOO 0
#endif

#ifndef PARATRAIN_HAS_HDF5
#define PARATRAIN_HAS_HDF5 0
#endif

#define PARATRAIN_VERSION_MAJOR 0
#define PARATRAIN_VERSION_MINOR 1
#define PARATRAIN_VERSION_PATCH 0
