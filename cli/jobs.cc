// moectl job submit / status / wait / list / cancel.
#include <iostream>

#include "agent_call.h"
#include "format.h"
#include "moe/spec/job_spec.h"

namespace moe::ctl {

namespace {

bool finished(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED || s == v1::JOB_STATE_CANCELLED;
}

// "router 0.002, dispatch 0.01, ..." for every phase that took time.
std::string phases_line(const v1::PhaseSeconds& p) {
  const auto* d = v1::PhaseSeconds::descriptor();
  std::string line;
  for (int f = 0; f < d->field_count(); ++f) {
    const double v = v1::PhaseSeconds::GetReflection()->GetDouble(p, d->field(f));
    if (v > 0) line += (line.empty() ? "" : ", ") + d->field(f)->name() + " " + fmt(v);
  }
  return line;
}

void print_job(std::ostream& out, const v1::JobResult& j, bool json) {
  if (json) {
    out << spec::to_json(j) << "\n";
    return;
  }
  std::vector<std::pair<std::string, std::string>> rows = {{"job", j.job_id()}, {"state", state_name(j.state())}};
  if (!j.message().empty()) rows.push_back({"message", j.message()});
  if (j.steps_completed() > 0) {
    const auto& p = j.phase_seconds();
    rows.push_back({"steps", fmt(j.steps_completed())});
    rows.push_back({"tokens/s", fmt(j.tokens_per_second(), 6)});
    rows.push_back({"step p50 (s)", fmt(j.step_seconds_p50())});
    rows.push_back({"phases (s)", phases_line(p)});
    const double ratio = j.naive_dispatch_bytes() > 0 ? j.dispatch_bytes() / j.naive_dispatch_bytes() : 0;
    rows.push_back({"dispatch bytes", fmt(j.dispatch_bytes(), 8) + " (" + fmt(100 * ratio, 3) + "% of naive)"});
    rows.push_back({"combine bytes", fmt(j.combine_bytes(), 8)});
    rows.push_back({"balancedness", fmt(j.balancedness())});
    for (const auto& [name, curve] : {std::pair{"loss", &j.loss()}, std::pair{"aux loss", &j.aux_loss()},
                                      std::pair{"z-loss", &j.z_loss()}})
      if (!curve->empty() && (curve->at(0) != 0 || curve->at(curve->size() - 1) != 0))
        rows.push_back({name, fmt(curve->at(0)) + " -> " + fmt(curve->at(curve->size() - 1)) + " (first and last step)"});
  }
  if (j.has_verify())
    rows.push_back({"verify", std::string(j.verify().passed() ? "passed" : "FAILED") + " (max abs " +
                                  fmt(j.verify().max_abs_error()) + ", max rel " + fmt(j.verify().max_rel_error()) + ")"});
  rows.push_back({"placement epoch", fmt(j.placement_epoch())});
  print_rows(out, rows);
}

int job_exit(const v1::JobResult& j) {
  if (j.state() == v1::JOB_STATE_SUCCEEDED) return kExitOk;
  return finished(j.state()) ? kExitJobFailed : kExitOk;
}

// Waits for a job, one agent-side wait at a time.
v1::JobResult wait_for(rpc::RpcClient& c, const std::string& id) {
  for (;;) {
    v1::Envelope req;
    req.mutable_wait_job()->set_job_id(id);
    const v1::Envelope reply = c.call(req, std::chrono::seconds(30));
    if (finished(reply.job().state())) return reply.job();
  }
}

}  // namespace

int job_submit(const Globals& g, const v1::JobSpec& given, bool wait, std::ostream& out, std::ostream& err) {
  v1::JobSpec spec = given;
  try {
    spec = spec::with_defaults(spec);
    spec::validate(spec);
  } catch (const moe::InvalidArgument& e) {
    err << "moectl: invalid spec: " << e.what() << "\n";
    return kExitUsage;
  }
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    *req.mutable_submit_job()->mutable_spec() = spec;
    v1::JobResult job = c.call(req, g.timeout).job();
    if (!wait) {
      if (g.json) out << spec::to_json(job) << "\n";
      else out << job.job_id() << "\n";
      return kExitOk;
    }
    if (!g.json) out << job.job_id() << " submitted\n";
    job = wait_for(c, job.job_id());
    print_job(out, job, g.json);
    return job_exit(job);
  });
}

int job_status(const Globals& g, const std::string& id, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    req.mutable_get_job()->set_job_id(id);
    print_job(out, c.call(req, g.timeout).job(), g.json);
    return kExitOk;
  });
}

int job_wait(const Globals& g, const std::string& id, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    const v1::JobResult job = wait_for(c, id);
    print_job(out, job, g.json);
    return job_exit(job);
  });
}

int job_list(const Globals& g, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    req.mutable_list_jobs();
    const v1::ListJobsReply list = c.call(req, g.timeout).list_jobs_reply();
    if (g.json) {
      out << spec::to_json(list) << "\n";
      return kExitOk;
    }
    if (list.jobs_size() == 0) {
      out << "no jobs yet\n";
      return kExitOk;
    }
    std::vector<std::vector<std::string>> rows = {{"JOB", "STATE", "MODE", "EXPERTS", "TOP-K", "STEPS", "TOKENS/S", "MESSAGE"}};
    for (const auto& j : list.jobs())
      rows.push_back({j.job_id(), state_name(j.state()), v1::JobSpec::Mode_Name(j.spec().mode()),
                      std::to_string(j.spec().experts()), std::to_string(j.spec().top_k()),
                      fmt(j.steps_completed()) + "/" + std::to_string(j.spec().steps()), fmt(j.tokens_per_second(), 6),
                      j.message()});
    print_table(out, rows);
    return kExitOk;
  });
}

int job_cancel(const Globals& g, const std::string& id, std::ostream& out, std::ostream& err) {
  return with_agent(g, err, [&](rpc::RpcClient& c, const Resolved&) {
    v1::Envelope req;
    req.mutable_cancel_job_request()->set_job_id(id);
    const v1::JobResult job = c.call(req, g.timeout).job();
    if (g.json) out << spec::to_json(job) << "\n";
    else out << job.job_id() << " " << state_name(job.state()) << (job.state() == v1::JOB_STATE_RUNNING ? " (cancelling)" : "") << "\n";
    return kExitOk;
  });
}

}  // namespace moe::ctl
