/**
 * The Mesh sidebar: every mesh on this machine, its hosts, procs (state, CPU and memory
 * sparklines, actors, RDMA buffers), and buttons. It only shows the model; actions are
 * callbacks given by the plugin (they need the notebook and the app).
 *
 * Past BIG ranks (as `%mesh top` and the tables of core/mesh_tables.py) a mesh shows a row a
 * host (its ranks and states, mean CPU, the memory its procs hold of their own) and then each
 * rank to look at (dead, paused or not answering): 256 rows of sparklines redrawn every second were a page
 * of their own. "all N ranks" shows a row a rank, under a line per host, until asked back.
 */
import { Widget } from '@lumino/widgets';

import { counts, countsText, held, IMesh, IProc, leaseText, LOST, lost, MeshModel, ranges, stateLabel } from './model';

export const BIG = 32; // ranks before a mesh shows a row a host

export interface IMeshActions {
  insertConnect(mesh: string): void;
  stop(mesh: string): void;
  respawn(mesh: string): void;
  logs(mesh: string): void;
  debug(mesh: string): void;
}

const esc = (s: unknown): string =>
  String(s).replace(/[&<>"']/g, c => `&#${c.charCodeAt(0)};`);

function spark(values: number[], max: number, color: string): string {
  if (values.length < 2) {
    return '<svg class="mk-spark" width="30" height="14"></svg>';
  }
  const w = 30;
  const h = 14;
  const top = Math.max(max, ...values, 1e-9);
  const pts = values
    .map((v, i) => `${((i / (values.length - 1)) * w).toFixed(1)},${(h - (v / top) * (h - 1)).toFixed(1)}`)
    .join(' ');
  return `<svg class="mk-spark" width="${w}" height="${h}"><polyline fill="none" stroke="${color}" stroke-width="1.2" points="${pts}"/></svg>`;
}

/** RDMA buffers registered on the mesh's procs: "3 (12.0 MiB)", or '' when none. */
function buffers(procs: IProc[]): string {
  let n = 0;
  let total = 0;
  for (const p of procs) {
    if (Array.isArray(p.buffers)) {
      n += p.buffers.length;
      total += p.buffers.reduce((s: number, x: any) => s + (x && x.size ? x.size : 0), 0);
    }
  }
  return n ? `${n} (${(total / 2 ** 20).toFixed(1)} MiB)` : '';
}

const num = (v: number | null | undefined, unit: string): string =>
  v === null || v === undefined ? '' : `${v.toFixed(0)}${unit}`;

function procRow(p: IProc, gpu: boolean): string {
  const full = stateLabel(p.state);
  const state = p.state.startsWith('paused') ? 'paused' : full; // the full text is the tooltip
  const cls = lost(p.state) ? 'mk-dead' : held(p.state) ? 'mk-paused' : '';
  return (
    `<tr class="mk-proc ${cls}" data-rank="${p.rank}" data-pid="${p.pid}" data-state="${esc(p.state)}" ` +
    `data-host="${esc(p.host)}"><td>${p.rank}</td>` +
    `<td class="mk-state" title="${esc(full)}">${esc(state)}</td>` +
    `<td>${spark(p.cpu_hist, 100, '#4a90d9')} ${num(p.cpu, '%')}</td>` +
    `<td>${spark(p.rss_hist, 0, '#8e44ad')} ${num(p.rss_mb, 'M')}</td>` +
    (gpu ? `<td>${spark(p.gpu_hist || [], 100, '#2e7d32')} ${num(p.gpu_util, '%')}</td>` : '') + // no GPU: no column
    '</tr>'
  );
}

/** The procs of each host, hosts in the order their first rank comes. */
function byHost(procs: IProc[]): Map<string, IProc[]> {
  const hosts = new Map<string, IProc[]>();
  for (const p of procs) {
    const list = hosts.get(p.host);
    list ? list.push(p) : hosts.set(p.host, [p]);
  }
  return hosts;
}

/** Per step of the last minute, the mean of the procs' histories, aligned on their latest
 * sample. */
function meanOf(hists: number[][]): number[] {
  const len = Math.max(0, ...hists.map(h => h.length));
  const out: number[] = [];
  for (let i = 0; i < len; i++) {
    const vals = hists.map(h => h[h.length - len + i]).filter(v => v !== undefined && v !== null);
    out.push(vals.length ? vals.reduce((a, b) => a + b, 0) / vals.length : 0);
  }
  return out;
}

function hostRow(host: string, procs: IProc[], gpu: boolean): string {
  const states = new Map<string, number>();
  for (const p of procs) {
    const s = p.state.startsWith('paused') ? 'paused' : stateLabel(p.state);
    states.set(s, (states.get(s) || 0) + 1);
  }
  const text = [...states.entries()].sort((a, b) => b[1] - a[1]).map(([s, n]) => `${n} ${s}`).join(' · ');
  const cls = [...states.keys()].some(lost) ? 'mk-dead' : [...states.keys()].some(held) ? 'mk-paused' : '';
  const cpu = procs.filter(p => p.cpu !== null && p.cpu !== undefined);
  const rss = procs.filter(p => p.rss_mb !== null && p.rss_mb !== undefined);
  const mean = cpu.length ? cpu.reduce((a, p) => a + (p.cpu as number), 0) / cpu.length : null;
  // what its procs hold of their own (USS): forked from one zygote, they share most pages
  const own = (p: IProc): number => (p.uss_mb !== null && p.uss_mb !== undefined ? p.uss_mb : (p.rss_mb as number));
  const total = rss.length ? rss.reduce((a, p) => a + own(p), 0) : null;
  const mem = total === null ? '' : total >= 1024 ? `${(total / 1024).toFixed(1)}G` : `${total.toFixed(0)}M`;
  const gpus = procs.filter(p => p.gpu_util !== null && p.gpu_util !== undefined);
  const gpuMean = gpus.length ? gpus.reduce((a, p) => a + (p.gpu_util as number), 0) / gpus.length : null;
  return (
    `<tr class="mk-host ${cls}" data-host="${esc(host)}" data-procs="${procs.length}">` +
    `<td><div>${esc(host)}</div><div class="mk-sub" title="ranks and their states">` +
    `${esc(ranges(procs.map(p => p.rank)))} · <span class="mk-state">${esc(text)}</span></div></td>` +
    `<td title="CPU, mean of its procs">${spark(meanOf(procs.map(p => p.cpu_hist)), 100, '#4a90d9')} ` +
    `${num(mean, '%')}</td>` +
    `<td title="memory its procs hold of their own (USS; the line: their RSS)">` +
    `${spark(meanOf(procs.map(p => p.rss_hist)), 0, '#8e44ad')} ${mem}</td>` +
    (gpu ? `<td>${spark(meanOf(procs.map(p => p.gpu_hist || [])), 100, '#2e7d32')} ${num(gpuMean, '%')}</td>` : '') +
    '</tr>'
  );
}

/** A row a rank; with several hosts, under a line naming each (no host column: the sidebar
 * is narrow). */
function rankTable(procs: IProc[], gpu: boolean): string {
  const hosts = byHost(procs);
  const cols = gpu ? 5 : 4;
  const rows = [...hosts.entries()]
    .map(([host, ps]) =>
      (hosts.size > 1 ? `<tr class="mk-host-line"><td colspan="${cols}">${esc(host)}</td></tr>` : '') +
      ps.map(p => procRow(p, gpu)).join(''))
    .join('');
  return (
    `<table class="mk-procs"><tr><th>rank</th><th>state</th><th>CPU</th><th>memory</th>${gpu ? '<th>GPU</th>' : ''}` +
    `</tr>${rows}</table>`
  );
}

function hostTable(procs: IProc[], gpu: boolean): string {
  const rows = [...byHost(procs).entries()].map(([host, ps]) => hostRow(host, ps, gpu)).join('');
  // (a host that is gone or does not answer is its row's news: its ranks are not listed again)
  const look = procs.filter(p => (lost(p.state) || held(p.state)) && p.state !== LOST && p.state !== 'unreachable');
  return (
    `<table class="mk-procs mk-hosts"><tr><th>host</th><th>CPU</th><th>memory</th>${gpu ? '<th>GPU</th>' : ''}</tr>` +
    `${rows}</table>` +
    (look.length
      ? `<div class="mk-extra">ranks to look at:</div>` +
        `<table class="mk-procs mk-look">${look.map(p => procRow(p, gpu)).join('')}</table>`
      : '')
  );
}

function meshBlock(m: IMesh, mine: boolean, allRanks: boolean): string {
  const c = counts(m);
  const status = !m.alive
    ? 'not running'
    : `${c.procs} procs on ${m.hosts.length === 1 ? m.hosts[0] : `${m.hosts.length} hosts`}` +
      countsText(c) + ` · ${leaseText(m)}`;
  const btn = (act: string, label: string, title: string, enabled = true) =>
    `<button class="jp-mod-styled mk-btn" data-action="${act}" data-mesh="${esc(m.name)}" title="${esc(title)}"` +
    `${enabled ? '' : ' disabled'}>${label}</button>`;
  const buttons = [
    btn('connect', 'insert connect cell', `insert "%mesh connect ${m.name}" into the notebook`),
    btn('logs', 'logs', 'the procs\' output kept on their hosts', m.alive),
    btn('respawn', 'respawn dead', mine ? 'replace dead procs (mesh.respawn())' :
      'connect a notebook to this mesh first', m.alive && c.dead > 0 && mine),
    btn('debug', 'debugger', mine ? 'open the debugger on the paused ranks' :
      'connect a notebook to this mesh first', m.alive && c.paused > 0 && mine),
    btn('stop', 'stop', 'stop every proc and agent of this mesh', m.alive)
  ].join('');
  const big = m.procs.length > BIG;
  const table = !m.procs.length ? '' : big && !allRanks ? hostTable(m.procs, m.gpu) : rankTable(m.procs, m.gpu);
  const toggle = big
    ? `<button class="jp-mod-styled mk-btn mk-toggle" data-action="ranks" data-mesh="${esc(m.name)}">` +
      `${allRanks ? 'a row a host' : `all ${m.procs.length} ranks`}</button>`
    : '';
  const actors = [...new Set(m.procs.flatMap(p => p.actors))].sort();
  const rdma = buffers(m.procs);
  const extra =
    (actors.length ? `<div class="mk-extra">actors: ${esc(actors.join(', '))}</div>` : '') +
    (rdma ? `<div class="mk-extra">RDMA buffers: ${esc(rdma)}</div>` : '');
  const badge = mine ? ' <span class="mk-badge">this notebook</span>' : '';
  return (
    `<div class="mk-mesh${c.dead + c.hostsGone ? ' mk-has-dead' : ''}" data-mesh="${esc(m.name)}">` +
    `<div class="mk-title"><b>${esc(m.name)}</b>${badge}</div><div class="mk-status">${esc(status)}</div>` +
    `<div class="mk-buttons">${buttons}</div>${table}${toggle}${extra}</div>`
  );
}

export class MeshPanel extends Widget {
  private allRanks = new Set<string>(); // big meshes shown a row a rank, by name

  constructor(private model: MeshModel, private actions: IMeshActions) {
    super();
    this.id = 'monarch-mesh-panel';
    this.addClass('mk-panel');
    this.title.caption = 'Monarch meshes';
    this.title.label = 'Mesh';
    model.onChange(() => this.render());
    this.node.addEventListener('click', e => this.onClick(e));
    this.render();
  }

  protected onAfterShow(): void {
    this.model.watch('panel', true);
  }

  protected onAfterHide(): void {
    this.model.watch('panel', false);
  }

  protected onBeforeDetach(): void {
    this.model.watch('panel', false);
  }

  render(): void {
    const d = this.model.data;
    const head = '<div class="mk-head">Meshes on this machine</div>';
    if (!d) {
      this.node.innerHTML = head + `<div class="mk-empty">${esc(this.model.error || 'loading...')}</div>`;
      return;
    }
    const body = d.meshes.length
      ? d.meshes.map(m => meshBlock(m, m.name === d.kernel_mesh, this.allRanks.has(m.name))).join('')
      : '<div class="mk-empty">No mesh yet: run <code>%mesh connect</code> in a Monarch notebook.</div>';
    const err = this.model.error ? `<div class="mk-error">${esc(this.model.error)}</div>` : '';
    this.node.innerHTML = head + err + body;
  }

  private onClick(e: MouseEvent): void {
    const b = (e.target as HTMLElement).closest('button[data-action]') as HTMLButtonElement | null;
    if (!b || b.disabled) {
      return;
    }
    const mesh = b.dataset.mesh as string;
    const act = b.dataset.action as string;
    if (act === 'ranks') {
      this.allRanks.has(mesh) ? this.allRanks.delete(mesh) : this.allRanks.add(mesh);
      this.render();
      return;
    }
    const fn: Record<string, (m: string) => void> = {
      connect: m => this.actions.insertConnect(m),
      stop: m => this.actions.stop(m),
      respawn: m => this.actions.respawn(m),
      logs: m => this.actions.logs(m),
      debug: m => this.actions.debug(m)
    };
    fn[act]?.(mesh);
  }
}
