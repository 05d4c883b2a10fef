// Status plumbing shared by the library's translation units.
#pragma once

#include <string>

#include "coda/coda.h"

namespace coda::detail {

// Records a message for last_error_message() and returns the status.
Status fail(Status status, const std::string& message);

}  // namespace coda::detail
