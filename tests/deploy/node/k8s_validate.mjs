// Validates deploy/k8s/*.yaml (run by tests/deploy/k8s_test.sh).
//
// usage: node k8s_validate.mjs --dir deploy/k8s --dashboard deploy/grafana/moed.json
//          --rules deploy/prometheus/rules.yml --ts OUT.ts
//          [--help moed=FILE --help moe-agent=FILE]
//
// 1. Every YAML document is constructed with the model class of its apiVersion/kind from
//    kubernetes-models or @kubernetes-models/prometheus-operator and validated against that
//    published schema (required fields, types, enums, patterns); an unknown kind is an error.
// 2. --ts writes every document as a typed TypeScript literal (`const d0: IDaemonSet = {...}`)
//    for tsc, whose excess property checks catch unknown or misspelt fields the JSON schemas allow.
// 3. Cross-object checks no schema can make: selectors match their pod templates, Services select
//    a workload and name its ports, volumes name a Secret that exists, the agent keeps its state
//    on a claim mounted at --state-dir, the daemons have host networking, IPC_LOCK, a memory
//    /dev/shm and probes on the metrics port, the GPU daemons request the GPUs they are told to
//    drive, the ServiceMonitor finds both Services and sets role and node, the generated
//    ConfigMap and PrometheusRule hold exactly deploy/grafana/moed.json and rules.yml, the
//    kustomization lists every manifest, and (with --help) every flag a container passes is one
//    its binary accepts.
import fs from 'node:fs';
import path from 'node:path';
import { parseAllDocuments, parse as parseYaml } from 'yaml';

const args = {};
const helps = {};
for (let i = 2; i < process.argv.length; i += 2) {
  const key = process.argv[i].replace(/^--/, '');
  const value = process.argv[i + 1];
  if (key === 'help') {
    const [bin, file] = value.split('=');
    helps[bin] = fs.readFileSync(file, 'utf8');
  } else {
    args[key] = value;
  }
}

const errors = [];
const error = (where, msg) => errors.push(`${where}: ${msg}`);

function modelPath(apiVersion, kind) {
  const [group, version] = apiVersion.includes('/') ? apiVersion.split('/') : ['', apiVersion];
  if (group === 'monitoring.coreos.com') return `@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`;
  return group ? `kubernetes-models/${group}/${version}/${kind}` : `kubernetes-models/${version}/${kind}`;
}

// Load every document.
const files = fs.readdirSync(args.dir).filter((f) => f.endsWith('.yaml')).sort();
const docs = [];
let kustomization = null;
for (const file of files) {
  const text = fs.readFileSync(path.join(args.dir, file), 'utf8');
  // YAML 1.1, as kubectl reads it (0440 is octal there).
  parseAllDocuments(text, { version: '1.1' }).forEach((d, i) => {
    const where = `${file}#${i}`;
    if (d.errors.length) return error(where, d.errors.map((e) => e.message).join('; '));
    const obj = d.toJS();
    if (obj === null) return;
    if (obj.kind === 'Kustomization') return void (kustomization = { file, obj });
    docs.push({ where: `${where} ${obj.kind}/${obj.metadata?.name}`, file, obj });
  });
}

// 1. Schemas.
const tsImports = new Map();
const tsDecls = [];
for (const [n, d] of docs.entries()) {
  const { apiVersion, kind } = d.obj;
  if (!apiVersion || !kind) { error(d.where, 'no apiVersion/kind'); continue; }
  const mod = modelPath(apiVersion, kind);
  let Model;
  try {
    Model = (await import(mod))[kind];
  } catch (e) {
    error(d.where, `no published model for ${apiVersion} ${kind} (${mod})`);
    continue;
  }
  try {
    new Model(d.obj).validate();
  } catch (e) {
    error(d.where, `schema: ${e.message}`);
  }
  tsImports.set(`I${kind}`, mod);
  tsDecls.push(`// ${d.where}\nexport const d${n}: I${kind} = ${JSON.stringify(d.obj, null, 2)};\n`);
}
if (args.ts) {
  const imports = [...tsImports].map(([t, m]) => `import type { ${t} } from '${m}';`).join('\n');
  fs.writeFileSync(args.ts, `${imports}\n\n${tsDecls.join('\n')}`);
}

// The cross-object checks below assume schema-valid objects.
if (errors.length) finish();

// 3. Cross-object checks.
const of = (kind) => docs.filter((d) => d.obj.kind === kind);
const byName = (kind, name) => of(kind).find((d) => d.obj.metadata?.name === name);
const matches = (selector, labels) =>
  !!selector && Object.keys(selector).length > 0 && Object.entries(selector).every(([k, v]) => labels?.[k] === v);
const workloads = [...of('DaemonSet'), ...of('StatefulSet'), ...of('Deployment')];
const namespaces = new Set(of('Namespace').map((d) => d.obj.metadata.name));

for (const d of docs) {
  const ns = d.obj.metadata?.namespace;
  if (d.obj.kind !== 'Namespace' && !namespaces.has(ns)) error(d.where, `namespace ${ns} is not one of the manifests' Namespaces`);
}

// Flags a container passes: --name=value or --name value.
function flagsOf(c) {
  return (c.args || []).filter((a) => a.startsWith('--')).map((a) => a.split('=')[0]);
}
function flagValue(c, flag) {
  const a = c.args || [];
  for (let i = 0; i < a.length; i++) {
    if (a[i].startsWith(`${flag}=`)) return a[i].slice(flag.length + 1);
    if (a[i] === flag) return a[i + 1];
  }
  return undefined;
}
function helpFlags(text) {
  return new Set([...text.matchAll(/^\s+(?:-\w,)?(--[a-z0-9-]+)/gm)].map((m) => m[1]));
}

for (const w of workloads) {
  const spec = w.obj.spec;
  const pod = spec.template?.spec || {};
  const podLabels = spec.template?.metadata?.labels || {};
  if (!matches(spec.selector?.matchLabels, podLabels)) error(w.where, 'selector.matchLabels does not match the pod template labels');
  const volumes = Object.fromEntries((pod.volumes || []).map((v) => [v.name, v]));
  const claims = Object.fromEntries((spec.volumeClaimTemplates || []).map((c) => [c.metadata.name, c]));
  for (const v of pod.volumes || []) {
    if (v.secret) {
      if ((v.secret.defaultMode ?? 0o644) & 0o007) error(w.where, `volume ${v.name}: a secret must not be world-readable (defaultMode)`);
      const s = byName('Secret', v.secret.secretName);
      const keys = v.secret.secretName === 'moed-tls-ca' ? ['ca.pem', 'ca.key'] : ['token'];
      if (!s) error(w.where, `volume ${v.name}: no Secret ${v.secret.secretName}`);
      else for (const k of keys) if (!(k in { ...s.obj.data, ...s.obj.stringData })) error(w.where, `Secret ${v.secret.secretName} has no key ${k}`);
    }
  }
  for (const c of pod.containers || []) {
    const cw = `${w.where} container ${c.name}`;
    const mounts = Object.fromEntries((c.volumeMounts || []).map((m) => [m.mountPath, m]));
    for (const m of c.volumeMounts || []) {
      if (!volumes[m.name] && !claims[m.name]) error(cw, `mount ${m.mountPath}: no volume or claim ${m.name}`);
    }
    const ports = Object.fromEntries((c.ports || []).map((p) => [p.name, p]));
    const binary = path.basename((c.command || [])[0] || '');
    if (!['moed', 'moe-agent'].includes(binary)) error(cw, `command ${c.command} is neither /usr/local/bin/moed nor moe-agent`);
    if (helps[binary]) {
      const known = helpFlags(helps[binary]);
      for (const f of flagsOf(c)) if (!known.has(f)) error(cw, `${binary} has no flag ${f} (its --help lists ${[...known].join(' ')})`);
    }
    // The token file is the mounted Secret's key.
    const tokenFile = flagValue(c, '--token-file');
    const tokenMount = tokenFile && mounts[path.dirname(tokenFile)];
    if (!tokenMount || !volumes[tokenMount.name]?.secret || path.basename(tokenFile) !== 'token') {
      error(cw, `--token-file ${tokenFile} is not the key token of a mounted Secret`);
    }
    // TLS: the three files in one memory-backed folder that an init container fills with
    // `moectl tls create` from the CA Secret; the CA key never reaches this container.
    const tlsDir = path.dirname(flagValue(c, '--tls-cert') || '');
    const tlsName = path.basename(flagValue(c, '--tls-cert') || '', '.pem');
    if (flagsOf(c).includes('--plaintext')) error(cw, 'runs without TLS (--plaintext)');
    if (flagValue(c, '--tls-key') !== `${tlsDir}/${tlsName}.key` || flagValue(c, '--tls-ca') !== `${tlsDir}/ca.pem`) {
      error(cw, '--tls-cert, --tls-key and --tls-ca must name NAME.pem, NAME.key and ca.pem of one folder');
    }
    const tlsVolume = mounts[tlsDir] && volumes[mounts[tlsDir].name];
    if (!tlsVolume?.emptyDir || tlsVolume.emptyDir.medium !== 'Memory') error(cw, `${tlsDir} must be a memory-backed emptyDir`);
    const issuer = (pod.initContainers || []).find((i) =>
      (i.volumeMounts || []).some((m) => m.name === mounts[tlsDir]?.name && m.mountPath === tlsDir) &&
      (i.args || []).join(' ').includes(`moectl tls create ${tlsDir} --name ${tlsName}`));
    if (!issuer) error(cw, `no init container runs moectl tls create ${tlsDir} --name ${tlsName}`);
    else if (!(issuer.volumeMounts || []).some((m) => volumes[m.name]?.secret?.secretName === 'moed-tls-ca')) {
      error(cw, `init container ${issuer.name} does not mount the CA Secret moed-tls-ca`);
    }
    if ((c.volumeMounts || []).some((m) => volumes[m.name]?.secret?.secretName === 'moed-tls-ca')) {
      error(cw, 'mounts the CA Secret: only the init container may hold the CA key');
    }
    // The metrics port: the flag, the container port named metrics and the probes agree.
    const metricsPort = Number((flagValue(c, '--metrics-port') || '').split(':').pop());
    if (!ports.metrics || ports.metrics.containerPort !== metricsPort) error(cw, `no container port metrics = --metrics-port (${metricsPort})`);
    for (const probe of ['readinessProbe', 'livenessProbe']) {
      const p = c[probe]?.httpGet;
      if (!p || p.port !== 'metrics' || p.path !== '/healthz') error(cw, `${probe} must GET /healthz on the metrics port`);
    }
    if (binary === 'moe-agent') {
      if (w.obj.kind !== 'StatefulSet' || spec.replicas !== 1) error(cw, 'the agent must be a one-replica StatefulSet');
      if (!byName('Service', spec.serviceName)) error(cw, `serviceName ${spec.serviceName} is not a Service`);
      const stateDir = flagValue(c, '--state-dir');
      if (!stateDir || !claims[mounts[stateDir]?.name]) error(cw, `--state-dir ${stateDir} is not a mounted PersistentVolumeClaim template`);
    }
    if (binary === 'moed') {
      if (w.obj.kind !== 'DaemonSet') error(cw, 'moed must run as a DaemonSet');
      if (!pod.hostNetwork) error(cw, 'moed needs hostNetwork');
      if (pod.dnsPolicy !== 'ClusterFirstWithHostNet') error(cw, 'with hostNetwork, dnsPolicy must be ClusterFirstWithHostNet to resolve the agent Service');
      if (!(c.securityContext?.capabilities?.add || []).includes('IPC_LOCK')) error(cw, 'moed needs the IPC_LOCK capability');
      const shm = mounts['/dev/shm'];
      if (!shm || volumes[shm.name]?.emptyDir?.medium !== 'Memory') error(cw, '/dev/shm must be a memory-backed emptyDir');
      if (!pod.nodeSelector || Object.keys(pod.nodeSelector).length === 0) error(cw, 'moed DaemonSets need a nodeSelector');
      const gpus = Number(c.resources?.limits?.['nvidia.com/gpu'] || 0);
      const backend = flagValue(c, '--backend');
      const devices = Number(flagValue(c, '--devices'));
      if (backend === 'cuda' && (gpus < 1 || gpus !== devices)) error(cw, `--devices ${devices} must equal the nvidia.com/gpu limit ${gpus}`);
      if (backend !== 'cuda' && gpus) error(cw, `a ${backend} daemon must not claim GPUs`);
      if (!/^(\$\(POD_IP\)|\d+\.\d+\.\d+\.\d+):\d+$/.test(flagValue(c, '--listen') || '')) error(cw, '--listen must be the node IP ($(POD_IP)) and a port: moed advertises it');
      const agent = flagValue(c, '--agent') || '';
      const [svc] = agent.split('.');
      if (!byName('Service', svc)?.obj.spec.ports.some((p) => agent.endsWith(`:${p.port}`))) error(cw, `--agent ${agent} is not a Service port`);
    }
  }
}
if (!of('DaemonSet').some((d) => d.obj.spec.template.spec.containers.some((c) => c.resources?.limits?.['nvidia.com/gpu']))) error('k8s', 'no GPU DaemonSet');
if (!of('DaemonSet').some((d) => d.obj.spec.template.spec.containers.some((c) => flagValue(c, '--backend') === 'cpu'))) error('k8s', 'no CPU DaemonSet');

// Services select a workload and name its ports.
for (const s of of('Service')) {
  const targets = workloads.filter((w) => matches(s.obj.spec.selector, w.obj.spec.template.metadata.labels));
  if (!targets.length) error(s.where, 'selects no workload');
  for (const p of s.obj.spec.ports || []) {
    for (const w of targets) {
      const names = w.obj.spec.template.spec.containers.flatMap((c) => (c.ports || []).map((q) => q.name));
      if (typeof p.targetPort === 'string' && !names.includes(p.targetPort)) error(s.where, `${w.where} has no port ${p.targetPort}`);
    }
  }
}

// The ServiceMonitor finds the agent and the daemons and labels them like file_sd does.
for (const m of of('ServiceMonitor')) {
  const services = of('Service').filter((s) => matches(m.obj.spec.selector.matchLabels, s.obj.metadata.labels));
  const ports = m.obj.spec.endpoints.map((e) => e.port);
  for (const component of ['agent', 'moed']) {
    const s = services.find((x) => x.obj.metadata.labels['app.kubernetes.io/component'] === component);
    if (!s) error(m.where, `selects no ${component} Service`);
    else if (!s.obj.spec.ports.some((p) => ports.includes(p.name))) error(m.where, `the ${component} Service has no port ${ports}`);
  }
  const targets = m.obj.spec.endpoints.flatMap((e) => (e.relabelings || []).map((r) => r.targetLabel));
  for (const label of ['role', 'node']) if (!targets.includes(label)) error(m.where, `no relabeling sets ${label}`);
  if (targets.includes('job')) error(m.where, 'sets the label job');
}

// The generated manifests hold exactly their sources.
const dashboard = fs.readFileSync(args.dashboard, 'utf8');
const cms = of('ConfigMap').filter((d) => d.obj.metadata.labels?.grafana_dashboard === '1');
if (cms.length !== 1) error('k8s', `expected one ConfigMap labelled grafana_dashboard=1, found ${cms.length}`);
else if (cms[0].obj.data?.['moed.json'] !== dashboard) error(cms[0].where, `data["moed.json"] differs from ${args.dashboard}: run deploy/k8s/generate.sh`);
const rules = parseYaml(fs.readFileSync(args.rules, 'utf8'));
const prs = of('PrometheusRule');
if (prs.length !== 1) error('k8s', `expected one PrometheusRule, found ${prs.length}`);
else if (JSON.stringify(prs[0].obj.spec) !== JSON.stringify(rules)) error(prs[0].where, `spec differs from ${args.rules}: run deploy/k8s/generate.sh`);

// The kustomization lists every manifest, and only those.
if (!kustomization) error('k8s', 'no kustomization.yaml');
else {
  const listed = [...(kustomization.obj.resources || [])].sort();
  const manifests = files.filter((f) => f !== kustomization.file);
  if (JSON.stringify(listed) !== JSON.stringify(manifests)) error(kustomization.file, `resources ${listed} != manifests ${manifests}`);
}

finish();

function finish() {
  if (errors.length) {
    for (const e of errors) console.log(`FAIL ${e}`);
    console.log(`${errors.length} problem(s) in ${args.dir}`);
    process.exit(1);
  }
  console.log(`ok: ${docs.length} objects valid (${[...new Set(docs.map((d) => d.obj.kind))].join(', ')})`);
  process.exit(0);
}
