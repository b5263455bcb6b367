#pragma once
/// \file
/// Moved: this header is now <paratrain/comm/mpi/mpi.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/comm/mpi/mpi.hpp

#include "paratrain/comm/mpi/mpi.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/comm/mpi.hpp> moved to <paratrain/comm/mpi/mpi.hpp>; the old path goes in the next release")
#endif
