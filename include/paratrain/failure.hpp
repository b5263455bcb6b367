#pragma once
/// \file
/// Moved: this header is now <paratrain/reliability/failure.hpp>; this forwarding header stays one release
/// (docs/architecture.md, "Moved headers"). Define PARATRAIN_ALLOW_MOVED_HEADERS to silence
/// the note.
// paratrain: moved to paratrain/reliability/failure.hpp

#include "paratrain/reliability/failure.hpp"

#ifndef PARATRAIN_ALLOW_MOVED_HEADERS
#pragma message("<paratrain/failure.hpp> moved to <paratrain/reliability/failure.hpp>; the old path goes in the next release")
#endif
