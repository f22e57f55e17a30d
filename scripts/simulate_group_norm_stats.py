"""NumPy simulation of the GroupNorm statistics kernels' arithmetic (lane
Welford in the accumulator dtype, double sums, Chan merges of lanes in double, the parallel-axis group finalize, the
(x - hi) * scale + offset apply), to check their numerics on a CPU.

    PYTHONPATH=. python scripts/simulate_group_norm_stats.py
"""
import numpy as np

from cupy_dwgn import reference

f = np.float32  # the accumulator dtype of half/float32 inputs
B = 8  # gn::kRowBatch
def chan(c,m,q,cb,mb,qb):
    if cb==0: return c,m,q
    t=c+cb; d=mb-m; w=cb/t; return t, m+d*w, q+qb+d*d*c*w
def lane_rows(r0,r1,l,L):
    span=r1-r0-l; return (span+L-1)//L if span>0 else 0
def sim(x, G, eps=1e-5, acc=f, cols_block=256, target=1024, min_rows=32):
    N=x.shape[0]; C=x.shape[-1]; xs=x.reshape(N,-1,C); S=xs.shape[1]; D=C//G
    cols=min(C,cols_block); lanes=cols_block//cols; colblocks=-(-C//cols)
    per=max(1,-(-target//(min(N,65535)*colblocks))); rpc=max(min_rows,-(-S//per)); nch=-(-S//rpc)
    means=np.zeros((N,G)); rstds=np.zeros((N,G)); y=np.zeros(xs.shape, acc)
    for n in range(N):
        part=np.zeros((nch,2,C))
        for k in range(nch):
            r0=k*rpc; r1=min(S,r0+rpc)
            for c in range(C):
                sums=[];m2s=[]
                for l in range(lanes):
                    mean=acc(0); m2=acc(0); cnt=acc(0); sm=0.0
                    rows=list(range(r0+l, r1, lanes)); whole=len(rows)//B*B
                    for k0 in range(0, whole, B):  # batches: own mean/M2, one Chan merge
                        v=[acc(xs[n,r,c]) for r in rows[k0:k0+B]]
                        bs=acc(0); bw=0.0
                        for e in v: bs=acc(bs+e); bw+=float(e)
                        bm=acc(bs*acc(1.0/B)); bm2=acc(0)
                        for e in v: d=acc(e-bm); bm2=acc(bm2+acc(d*d))
                        sm+=bw; prev=cnt; cnt=acc(cnt+acc(B)); d=acc(bm-mean)
                        w=acc(acc(B)*acc(acc(1)/cnt)); mean=acc(mean+acc(d*w))
                        m2=acc(m2+acc(bm2+acc(acc(acc(d*d)*prev)*w)))
                    for r in rows[whole:]:
                        v=acc(xs[n,r,c]); sm+=float(v); cnt=acc(cnt+acc(1)); d=acc(v-mean)
                        mean=acc(mean+acc(d*acc(acc(1)/cnt))); m2=acc(m2+acc(d*acc(v-mean)))
                    sums.append(sm); m2s.append(float(m2))
                cnt=lane_rows(r0,r1,0,lanes); mean=sums[0]/cnt; m2=m2s[0]; total=sums[0]
                for j in range(1,lanes):
                    cj=lane_rows(r0,r1,j,lanes)
                    if cj>0:
                        cnt,mean,m2=chan(cnt,mean,m2,cj,sums[j]/cj,m2s[j]); total+=sums[j]
                part[k,0,c]=total; part[k,1,c]=m2
        for g in range(G):  # parallel-axis theorem over the (chunk, channel) pieces
            gm=sum(part[k,0,c] for k in range(nch) for c in range(g*D,(g+1)*D))/(S*D); m2t=0.0
            for k in range(nch):
                rows=min(S-k*rpc,rpc)
                for c in range(g*D,(g+1)*D):
                    d=part[k,0,c]-rows*gm; m2t+=part[k,1,c]+d*d/rows
            var=m2t/(S*D); rstd=1/np.sqrt(var+eps)
            means[n,g]=acc(gm); rstds[n,g]=acc(rstd)
            hi=acc(gm); lo=gm-float(hi); scale=acc(rstd)
            off=acc(0.0-lo*float(scale))
            sl=slice(g*D,(g+1)*D)
            y[n,:,sl]=acc(acc(acc(xs[n,:,sl].astype(acc)-hi)*scale)+off)
    return y.reshape(x.shape), means, rstds
def rel(a,b): return np.linalg.norm(a.astype(np.float64)-b)/np.linalg.norm(b)
rng=np.random.default_rng(1)
for trial in range(3):
    x=(1000+rng.standard_normal((2,9,11,32))).astype(f)
    y,m,r=sim(x,8); ry,rm,rr=reference.group_norm(x,8,return_stats=True)
    print('1000+randn f32: y %.2e mean %.2e rstd %.2e'%(rel(y,ry),rel(m,rm),rel(r,rr)))
for spike in (64,512):
    x=(3+rng.standard_normal((1,4096,8))).astype(f); x[0,0,:]+=spike
    y,m,r=sim(x,2); ry,rm,rr=reference.group_norm(x,2,return_stats=True)
    print('spike %d: y %.2e mean %.2e rstd %.2e'%(spike,rel(y,ry),rel(m,rm),rel(r,rr)))
x=(3+rng.standard_normal((2,5,7,24))).astype(f)
y,m,r=sim(x,4); ry,rm,rr=reference.group_norm(x,4,return_stats=True)
print('3+randn: y %.2e mean %.2e rstd %.2e'%(rel(y,ry),rel(m,rm),rel(r,rr)))
x=(1000+rng.standard_normal((2,9,11,32))).astype(np.float16)
y,m,r=sim(x,8); ry,rm,rr=reference.group_norm(x,8,return_stats=True)
print('1000+randn f16 (acc f32, y stored f32 here): y %.2e mean %.2e rstd %.2e'%(rel(y,ry),rel(m,rm),rel(r,rr)))
# Few, long chunks (target=8 blocks), so each lane walks many whole batches.
for trial in range(2):
    x=(1000+rng.standard_normal((2,64,64,32))).astype(f)
    y,m,r=sim(x,8,target=8); ry,rm,rr=reference.group_norm(x,8,return_stats=True)
    print('batched 1000+randn f32: y %.2e mean %.2e rstd %.2e'%(rel(y,ry),rel(m,rm),rel(r,rr)))
x=(3+rng.standard_normal((1,4099,8))).astype(f); x[0,0,:]+=512; x[0,1234,3]-=300
y,m,r=sim(x,2,target=2); ry,rm,rr=reference.group_norm(x,2,return_stats=True)
print('batched spikes: y %.2e mean %.2e rstd %.2e'%(rel(y,ry),rel(m,rm),rel(r,rr)))
