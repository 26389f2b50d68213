// moectl's commands (docs/cli.md#commands), as a library the tests can link.
// main() parses flags into these calls; each returns the process exit code
// (docs/cli.md#exit-codes):
//   0 ok, 1 job failed (or cancelled), 2 usage or invalid spec, 3 agent
//   unreachable or timed out.
#pragma once

#include <chrono>
#include <iosfwd>
#include <optional>
#include <string>

#include "moe/rpc/client.h"
#include "moe/v1/rpc.pb.h"

namespace moe::ctl {

constexpr int kExitOk = 0, kExitJobFailed = 1, kExitUsage = 2, kExitUnreachable = 3;
// `job wait --timeout` ran out with the job still queued or running.
constexpr int kExitTimedOut = 4;

struct Globals {
  // Flags, or their environment variables (the main reads both).
  std::string agent;       // --agent / MOE_AGENT (else the state dir's, 127.0.0.1:7400)
  std::string token_file;  // --token-file / MOE_TOKEN_FILE (else the state dir's)
  std::string state_dir;   // --state-dir / MOE_STATE_DIR (else ~/.local/state/moed)
  rpc::TlsFiles tls;       // --tls-* / MOE_TLS_* (else the state dir's tls/, if any, for its own agent)
  bool plaintext = false;  // --plaintext: plain TCP to an agent started with --plaintext
  bool json = false;       // --output json
  std::chrono::milliseconds timeout{10000};
};

// Fills agent, token, TLS files and state dir from Globals and the state dir.
struct Resolved {
  std::string agent, token, state_dir;
  rpc::TlsFiles tls;
  // No silent plaintext: without TLS files the token goes in clear only to an
  // agent the user said speaks plaintext (--plaintext) or to the state
  // directory's own plaintext cluster (`cluster up --plaintext` leaves no tls/).
  bool plaintext_ok = false;
};
Resolved resolve(const Globals& g);

struct ClusterUpOptions {
  int nodes = 1;
  int devices_per_node = 1;
  std::string backend = "auto";
  std::chrono::milliseconds ready_timeout{60000};
  // moe-agent flags passed through ("--load-window", "32", ...): placement and
  // auto-rebalance settings.
  std::vector<std::string> agent_args;
  double agent_grace = 30;  // seconds: moed's and the agent's --agent-grace
  double stop_grace = 5;    // seconds: moed's --stop-grace
  bool plaintext = false;   // no TLS (else a CA and certificates in <state-dir>/tls)
};

int cluster_up(const Globals& g, const ClusterUpOptions& o, std::ostream& out, std::ostream& err);
int cluster_down(const Globals& g, std::ostream& out, std::ostream& err);

// moectl tls create DIR: DIR/ca.pem and ca.key (made if absent), and
// DIR/NAME.pem and NAME.key for each name, naming `hosts` (docs/control-plane.md#tls).
struct TlsCreateOptions {
  std::string dir;
  std::vector<std::string> names;
  std::vector<std::string> hosts;
  int days = 365;
};
int tls_create(const TlsCreateOptions& o, std::ostream& out, std::ostream& err);
int cluster_status(const Globals& g, std::ostream& out, std::ostream& err);

// Local clusters (docs/cli.md#local-clusters): restart node NAME, or the agent,
// from the command line `cluster up` recorded, and wait until it serves (a
// restarted node registered again under its index).
int node_restart(const Globals& g, const std::string& name, std::ostream& out, std::ostream& err);
int agent_restart(const Globals& g, std::ostream& out, std::ostream& err);
struct LogsOptions {
  std::string name;     // "agent" or a node's name
  bool follow = false;  // then what is appended, until interrupted
  int tail = 0;         // only the last N lines (0: all)
};
int logs(const Globals& g, const LogsOptions& o, std::ostream& out, std::ostream& err);

struct WaitOptions {
  bool wait = false;                 // submit: wait for the job to end
  std::optional<double> timeout_s;   // give up waiting after this long (exit 4; the job runs on)
};
// Submits `spec` as built by JobFlags::build (the --hf-config fields, the -f file
// over them, the given flags over both), after filling its defaults and
// validating it. Prints the job id (the record with --output json) and exits 0;
// with `wait`, waits for the job to end, prints its result, and exits 0 if it
// succeeded, 1 if it failed or was cancelled. Waits stream a progress line per
// step to stderr when it is a terminal; Ctrl-C stops waiting (130) and says how
// to reattach and cancel.
int job_submit(const Globals& g, const v1::JobSpec& spec, const WaitOptions& w, std::ostream& out, std::ostream& err);
// The record; with `watch`, a line per step until the job ends, then the record.
int job_status(const Globals& g, const std::string& id, bool watch, std::ostream& out, std::ostream& err);
int job_wait(const Globals& g, const std::string& id, const WaitOptions& w, std::ostream& out, std::ostream& err);
struct ListOptions {
  std::vector<std::string> states;    // "running,queued", repeatable; empty: every state
  std::vector<std::string> selector;  // KEY=VALUE labels a job must carry
};
// In submit order; each row cut to the terminal's width (160 columns off a terminal).
int job_list(const Globals& g, const ListOptions& o, std::ostream& out, std::ostream& err);
int job_cancel(const Globals& g, const std::string& id, std::ostream& out, std::ostream& err);
// Which placement a command is about (docs/placement.md#cluster-state): a shape
// "EXPERTSxLAYERS@NODESxDEVICES" (empty: the last job's) and optionally one layer.
struct PlacementTarget {
  std::string shape;
  std::optional<int> layer;
};
int placement_show(const Globals& g, const PlacementTarget& t, std::ostream& out, std::ostream& err);
// EPLB's phy2log / log2phy / logcnt of a shape as JSON, and back (a new epoch).
int placement_export(const Globals& g, const PlacementTarget& t, const std::string& file, std::ostream& out,
                     std::ostream& err);
int placement_import(const Globals& g, const std::string& file, std::ostream& out, std::ostream& err);
// Forgets the shape's maps and load window: its next job starts afresh.
int placement_reset(const Globals& g, const PlacementTarget& t, std::ostream& out, std::ostream& err);
// The load window as a loads file of moe-placement-sim --loads.
int placement_loads(const Globals& g, const PlacementTarget& t, const std::string& file, std::ostream& out,
                    std::ostream& err);

struct RebalanceOptions {
  PlacementTarget target;
  std::optional<int> redundant_experts;
  bool dry_run = false;
};
// Exit 0 committed (or a dry run), 1 aborted or failed (the message names the
// copy), 2 a request that breaks the slot rule, 3 unreachable.
int placement_rebalance(const Globals& g, const RebalanceOptions& o, std::ostream& out, std::ostream& err);

// A training checkpoint (a step folder, or a checkpoint_dir for its latest
// complete step): step, spec, maps and the bytes per rank; exit 2 naming the
// file when it is incomplete, missing a file or truncated.
int checkpoint_show(const Globals& g, const std::string& dir, std::ostream& out, std::ostream& err);

struct TopOptions {
  bool once = false;          // one frame, no escape codes
  std::optional<int> layer;   // only this layer
};
// moectl top: the agent's live load drawn in place once a second on a terminal
// until q (exit 0) or SIGINT / SIGTERM (128 + the signal), the terminal
// restored; one frame with once; the reply as JSON with g.json.
int top(const Globals& g, const TopOptions& o, std::ostream& out, std::ostream& err);

}  // namespace moe::ctl
