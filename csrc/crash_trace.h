// A native backtrace of the thread that crashes, for tests: Python's faulthandler prints the Python stack
// of every Python thread, so a crash in a thread that never ran Python (gloo's, the engine's) shows no
// frame of its own there.
#pragma once

namespace bagua_lite {

// Installs handlers of SIGSEGV, SIGBUS, SIGILL, SIGFPE and SIGABRT that write the crashing thread's native
// backtrace to stderr, then hand the signal to the handler installed before them (faulthandler's, or the
// default). Returns false if they were installed already (nothing is done then).
bool install_crash_trace();

}  // namespace bagua_lite
