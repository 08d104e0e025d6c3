#pragma once
// The launcher's signals: SIGINT, SIGTERM and SIGCHLD only set a flag and wake the poll loop
// through a self-pipe; a rank gets the default dispositions back before exec.
#include <csignal>

namespace fsdp_run {

extern int g_wake_pipe[2];                   // the self-pipe: the handlers write to [1], poll() watches [0]
extern volatile sig_atomic_t g_got_sigint;   // set by the handler; cleared by whoever acts on it
extern volatile sig_atomic_t g_got_sigterm;  // likewise

// Creates the self-pipe and installs the handlers (SIGPIPE ignored); false if the pipe cannot be made.
bool install_signal_handlers();

// In a freshly forked rank: undo everything the launcher changed, because
// ignored signals (SIGPIPE) would otherwise stay ignored across exec.
void restore_default_signals(const sigset_t& original_mask);

// Empties the self-pipe after a wake-up.
void drain_wake_pipe();

}  // namespace fsdp_run
