#pragma once
/// \file
/// Training that survives lost ranks without a restart (docs/elastic.md): elastic::fit,
/// elastic::Membership. Needs comm::Gloo (link paratrain::gloo).

#include "paratrain/elastic/fit.hpp"
#include "paratrain/elastic/membership.hpp"
#include "paratrain/elastic/snapshot.hpp"
