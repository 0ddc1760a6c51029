// Human-readable numbers for logs, tables and messages: bytes in binary units, durations, counts.
// The one formatter the trainer, the report, the plan, the pool and the collectives share.
#pragma once

#include <string>

namespace zt {

// "512 B", "12.34 KiB", "1.50 GiB", "2.00 TiB": binary units, `decimals` digits above 1 KiB.
std::string format_bytes(double bytes, int decimals = 2);
// "1:07" or "2:03:45" (rounded to the second).
std::string format_hms(double seconds);
// "999 tok/s", "1.23 ktok/s", "4.56 Mtok/s": decimal (SI) prefixes up to P, two decimals above 1000.
std::string format_si(double value, const char* unit = "");
// Compact counts for progress lines: "812", "12.3k", "1.25M".
std::string format_count(double value);

}  // namespace zt
